"""The data of a fault-tolerant run (``ddpkit run --fault-tolerant``): each optimizer step's
global batch split over the replicas alive at that step, its position the count of committed
steps, so that a step that did not commit is drawn again by whoever is alive then.

Nothing here knows who is alive: :class:`LiveLoader` asks its ``live`` object (the engine's
:class:`~ddpkit.engines.live.Live`) for the step, the quorum, and to begin each step.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
from torch.utils.data import Dataset, default_collate

from ..base.errors import ConfigError
from .batch import Batch
from .seeds import SeededEachSample

__all__ = ["steps_per_epoch", "epoch_order", "step_share", "LiveLoader", "live_loader"]


def steps_per_epoch(samples: int, global_batch: int, drop_last: bool = False) -> int:
    """Optimizer steps in one epoch: a short last batch is a step unless ``drop_last``.

    Example::

        steps_per_epoch(91, 8)   # 12 (the last step takes 3 samples)
    """
    return samples // global_batch if drop_last else -(-samples // global_batch)


def epoch_order(samples: int, seed: int, epoch: int, shuffle: bool = True) -> List[int]:
    """The epoch's order of samples, the same on every replica (DistributedSampler's draw).

    Example::

        epoch_order(5, seed=0, epoch=1)   # a permutation of 0..4
    """
    if not shuffle:
        return list(range(samples))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(samples, generator=g).tolist()


def step_share(order: Sequence[int], step: int, global_batch: int, rank: int,
               replicas: int) -> Tuple[List[int], int]:
    """Replica ``rank`` of ``replicas``: its samples of the epoch's step ``step``, and how many
    of them count. The step's batch is cut in contiguous shares, the first ones one larger; a
    replica left without a sample (a last batch smaller than the replicas) takes the batch's
    first sample, counted 0 (its gradient weighs nothing, see :class:`~ddpkit.engines.live.Live`).

    Example::

        step_share(list(range(10)), 0, 8, rank=1, replicas=3)   # ([3, 4, 5], 3)
    """
    batch = list(order[step * global_batch:(step + 1) * global_batch])
    base, extra = divmod(len(batch), replicas)
    start = rank * base + min(rank, extra)
    mine = batch[start:start + base + (1 if rank < extra else 0)]
    return (mine, len(mine)) if mine else (batch[:1], 0)


class _Live(Protocol):  # what the loader needs from the engine's live state
    step: int
    def begin_step(self) -> Tuple[int, int]: ...
    def record_share(self, indices: List[int]) -> None: ...
    def counted(self, samples: int, global_samples: int) -> None: ...


class LiveLoader:
    """``rt.loader`` in a fault-tolerant run: each batch it gives is this replica's share of one
    optimizer step's global batch (``batch_size``), among the replicas of that step's quorum.
    The position is the committed step: a step that did not commit (a replica died during it)
    is given again, split over the survivors, so every sample of an epoch is trained once.
    Each sample's random draws come from its own seed (run seed, epoch, sample), whoever
    fetches it. Samples are fetched in this process, once the step's quorum is known.

    Example::

        loader = rt.loader(train_set, batch_size=96)   # under ddpkit run --fault-tolerant
        for x, y in loader:
            ...   # this replica's part of the 96 samples of the step
    """

    def __init__(self, dataset: Dataset, global_batch: int, live: _Live, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False,
                 collate_fn: Optional[Callable] = None) -> None:
        self.dataset, self.live, self.seed, self.shuffle = dataset, live, seed, shuffle
        self.samples = len(dataset)  # type: ignore[arg-type]
        self.steps = steps_per_epoch(self.samples, global_batch, drop_last)
        if self.steps == 0:
            raise ConfigError(f"rt.loader: {self.samples} samples with a global batch of "
                              f"{global_batch} and drop_last=True give no step; use a smaller "
                              "batch or drop_last=False")
        self.batch = Batch(global_batch, 1, 1, global_batch)
        self.batch_size = global_batch
        self.resident = None  # samples are fetched each step, once its quorum is known
        self.collate = collate_fn or default_collate
        self._data = SeededEachSample(dataset, seed, self.samples)
        self.epoch = self.live.step // self.steps
        #: the samples of the batch given last, and how many of them count
        self.last_indices: List[int] = []
        self.last_counted = 0
        self._given = -1  # the step of its epoch the batch given last belongs to
        self._order: Tuple[int, List[int]] = (-1, [])  # (epoch, its order of samples)
        self._expected: Optional[int] = None  # the loop's epoch for the next pass, once known
        self._next = self.epoch + 1

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int) -> None:
        """The loop's epoch (scripts written for ``DistributedSampler`` call it): a pass for an
        epoch the job has finished already gives nothing (see :meth:`__iter__`)."""
        self._expected = int(epoch)

    def end_pass(self) -> None:
        """Accepted (``fit`` calls it at an epoch's end): a pass ends with its epoch's steps."""

    @property
    def at_last_batch(self) -> bool:
        """True while the batch given last is the last step of its epoch."""
        return self._given == self.steps - 1

    def __iter__(self) -> Iterator[Any]:
        # The loop counts its epochs itself, one a pass. A replica that took a peer's state
        # (a heal) mid-pass may be whole epochs behind the job: those passes give nothing, so
        # the loop's epoch is the data's again and the loop ends with the job's last epoch.
        expected = self.live.step // self.steps if self._expected is None else self._expected
        self._expected = None
        self.epoch = self.live.step // self.steps
        if expected < self.epoch:
            self._expected = expected + 1
            return
        self._next = self.epoch + 1
        while self.live.step // self.steps == self.epoch:
            rank, replicas = self.live.begin_step()  # a heal may move the step
            epoch, k = divmod(self.live.step, self.steps)
            if epoch != self.epoch:
                break
            if self._order[0] != epoch:  # one draw an epoch, not one a step
                self._order = (epoch, epoch_order(self.samples, self.seed, epoch, self.shuffle))
            order = self._order[1]
            indices, counted = step_share(order, k, self.batch.global_batch, rank, replicas)
            global_samples = len(order[k * self.batch.global_batch:
                                       (k + 1) * self.batch.global_batch])
            self.live.counted(counted, global_samples)
            self.live.record_share(indices[:counted])
            self.last_indices, self.last_counted, self._given = indices, counted, k
            tagged = [epoch * self.samples + i for i in indices]
            yield self.collate(self._data.__getitems__(tagged))
        self._expected = self._next

    def state_dict(self) -> dict:
        """The position: the committed step (the epoch and the samples of it done follow).

        Example::

            loader.state_dict()   # {'epoch': 1, 'samples_done': 96, 'step': 13, ...}
        """
        epoch, k = divmod(self.live.step, self.steps)
        return {"epoch": epoch, "samples_done": min(k * self.batch.global_batch, self.samples),
                "step": self.live.step, "seed": self.seed, "world_size": 1, "pad_base": 0}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s position (from a checkpoint on disk; a heal brings the step
        with the peer's state)."""
        if state.get("seed", self.seed) != self.seed:
            raise ConfigError(f"checkpoint was shuffled with seed {state['seed']}, this run "
                              f"uses {self.seed}; resume with the same seed")
        if "step" in state:
            self.live.step = int(state["step"])
        else:  # a checkpoint of a run that was not fault-tolerant
            self.live.step = int(state["epoch"]) * self.steps + \
                -(-int(state["samples_done"]) // self.batch.global_batch)
        self.epoch = self.live.step // self.steps


#: rt.loader's arguments that mean the same in a fault-tolerant run.
_KEPT = ("seed", "shuffle", "drop_last", "collate_fn")
#: ... and those a step split over the live replicas makes moot (fetching stays in-process).
_MOOT = ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor", "resident",
         "seed_each_sample", "device", "timeout")


def live_loader(dataset: Dataset, batch_size: int, live: _Live, **kwargs: Any) -> LiveLoader:
    """``rt.loader(...)`` in a fault-tolerant run: a :class:`LiveLoader` of the global batch.

    Example::

        live_loader(train_set, 96, live, seed=0, num_workers=2)
    """
    accum = kwargs.pop("accum_steps", 1)
    if accum != 1 or kwargs.pop("per_rank_batch", None) is not None:
        raise ConfigError("a fault-tolerant run splits each step's global batch over the "
                          "replicas alive at that step: give rt.loader the global batch alone "
                          "(no accum_steps= or per_rank_batch=)")
    unknown = sorted(set(kwargs) - set(_KEPT) - set(_MOOT))
    if unknown:
        raise ConfigError(f"rt.loader in a fault-tolerant run does not take {unknown[0]}=; it "
                          f"takes {', '.join(_KEPT)}")
    return LiveLoader(dataset, batch_size, live,
                      **{k: v for k, v in kwargs.items() if k in _KEPT})
