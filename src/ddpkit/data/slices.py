"""A language model's data without a Dataset: one long token tensor cut into columns (streams)
and read in BPTT slices, as PyTorch's word_language_model does, split across ranks by column,
with the position (epoch, row) a checkpoint keeps: ``rt.checkpointer(loader=...)`` takes it."""
from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch

from ..base.errors import ConfigError
from .batch import Batch

__all__ = ["SliceLoader"]


class SliceLoader:
    """``(input, target)`` slices of ``bptt`` rows from ``tokens`` laid out as ``batch_size``
    columns (the global batch: each column a stream that a recurrent state follows); each rank
    reads its own ``batch_size / world`` adjacent columns, so N ranks read together exactly what
    one process reads. Every pass is the next epoch; ``state_dict`` holds the epoch and the rows
    done, so a resumed run continues with the very next slice (keep the recurrent state per rank
    in ``extra=``: it differs between ranks).

    Example::

        loader = SliceLoader(tokens, batch_size=20, bptt=35, rank=rt.rank, world=rt.world_size)
        for x, y in loader:                    # x: (35, 20 / world), y: the next tokens
            ...
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, bptt: int, rank: int = 0,
                 world: int = 1) -> None:
        if tokens.dim() != 1:
            raise ConfigError(f"tokens must be one long 1-D tensor of token ids, got shape "
                              f"{tuple(tokens.shape)}")
        if bptt < 1 or batch_size < 1 or batch_size % world:
            raise ConfigError(f"batch_size={batch_size} columns must split evenly over {world} "
                              f"ranks (a multiple of {world}) and bptt={bptt} must be >= 1")
        rows = tokens.numel() // batch_size  # as word_language_model's batchify: the rest dropped
        if rows < 2:
            raise ConfigError(f"{tokens.numel()} tokens make fewer than 2 rows of {batch_size} "
                              "columns: nothing to predict; use fewer columns or more data")
        share = batch_size // world
        grid = tokens[:rows * batch_size].view(batch_size, rows).t()  # column j: one stream
        self.columns = grid[:, rank * share:(rank + 1) * share].contiguous()
        self.bptt, self.batch_size = bptt, share  # as torch's DataLoader: this rank's batch
        #: the optimizer step's batch (global columns, ranks, no accumulation, this rank's)
        self.batch = Batch(batch_size, world, 1, share)
        self.epoch = -1        # the pass in progress (or last finished)
        self.row = 0           # rows of this pass handed out (the next slice starts here)
        self._resume: Dict[str, int] = {}
        self._finished = False

    def __len__(self) -> int:
        """Slices in a full epoch."""
        return -(-(self.columns.shape[0] - 1) // self.bptt)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        resume, self._resume = self._resume, {}
        self.epoch = resume["epoch"] if resume else self.epoch + 1
        self.row, self._finished = resume.get("samples_done", 0), False
        last = self.columns.shape[0] - 1
        while self.row < last:
            start, n = self.row, min(self.bptt, last - self.row)
            self.row += n
            yield self.columns[start:start + n], self.columns[start + 1:start + 1 + n]
        self._finished = True

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (a resume into that epoch keeps its place)."""
        if self._resume.get("epoch") != epoch:
            self._resume = {"epoch": epoch, "samples_done": 0}

    @property
    def at_last_batch(self) -> bool:
        """True while the slice just handed out is the last of this pass."""
        return self.epoch >= 0 and not self._resume and self.row >= self.columns.shape[0] - 1

    def state_dict(self) -> Dict[str, Any]:
        """The epoch the next slice belongs to and the rows of it done (a finished pass: the
        next epoch, from row 0); the same on every rank."""
        if self._resume:
            return dict(self._resume)
        if self._finished or self.epoch < 0:
            return {"epoch": self.epoch + 1, "samples_done": 0}
        return {"epoch": self.epoch, "samples_done": self.row}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue at ``state``'s position on the next pass."""
        self._resume = {"epoch": int(state["epoch"]), "samples_done": int(state["samples_done"])}
