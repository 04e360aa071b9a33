"""What ``rt.loader`` tells ``ddpkit verify``'s probe (``LoaderWatch``, a part of
:class:`ddpkit.verify.probe.Probe`): how the training loader was built, the samples of each batch
it hands out (counted for a step once a training forward takes them), the samples of each pass,
and the generators a sample's ``__getitem__`` drew from.
"""
from __future__ import annotations

import random
import sys
import zlib
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from . import probe_watch as watch

__all__ = ["LoaderWatch", "multiset_hash", "stream_digests", "content_digest", "dataset_digests"]

_MASK = (1 << 64) - 1


def multiset_hash(indices: Iterable[int]) -> int:
    """An order-free checksum of a multiset of sample indices: the sum (mod 2**64) of each
    index's splitmix64, so the ranks' checksums add up to the whole run's.

    Example::

        multiset_hash([3, 1]) == multiset_hash([1, 3])   # True
    """
    total = 0
    for i in indices:
        x = (int(i) + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        total = (total + (x ^ (x >> 31))) & _MASK
    return total


def stream_digests() -> Dict[str, int]:
    """A CRC-32 of the state of torch's CPU generator, Python's ``random`` and NumPy's global
    generator, by name: equal on two ranks, they draw the same numbers next.

    Example::

        stream_digests()   # {'torch': 2216..., 'random': 91..., 'numpy': 3020...}
    """
    out = {"torch": zlib.crc32(torch.random.get_rng_state().numpy().tobytes()),
           "random": zlib.crc32(repr(random.getstate()).encode())}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = zlib.crc32(numpy.random.get_state()[1].tobytes())
    return out


def content_digest(value: Any) -> int:
    """A CRC-32 of what a sample holds (tensors, arrays, numbers, text, nested in tuples, lists
    and dicts; an image through NumPy), alike in every process for equal contents.

    Example::

        content_digest((torch.ones(3), 1)) == content_digest((torch.ones(3), 1))   # True
    """
    if torch.is_tensor(value):
        return zlib.crc32(value.detach().cpu().contiguous().view(-1).view(torch.uint8)
                          .numpy().tobytes()) if value.numel() else 0
    if isinstance(value, dict):
        return zlib.crc32(repr([(repr(k), content_digest(v)) for k, v in value.items()]).encode())
    if isinstance(value, (list, tuple)):
        return zlib.crc32(repr([content_digest(v) for v in value]).encode())
    if isinstance(value, (int, float, str, bytes, bool)) or value is None:
        return zlib.crc32(repr(value).encode())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            return zlib.crc32(numpy.ascontiguousarray(numpy.asarray(value)).tobytes())
        except Exception:  # noqa: BLE001 - a sample NumPy cannot read: its type alone
            pass
    return zlib.crc32(type(value).__name__.encode())


def dataset_digests(dataset: Any) -> Optional[List[List[int]]]:
    """``[index, checksum]`` of the dataset's first, middle and last samples, each fetched with
    every generator seeded alike and put back after (augmentation draws the same on every
    rank, and the script's own draws are left as they were); None where a fetch fails.

    Example::

        dataset_digests(TensorDataset(torch.arange(10)))   # [[0, ...], [5, ...], [9, ...]]
    """
    from ..base.seed import preserved_rng, seed_everything
    try:
        n = len(dataset)
        out = []
        for i in sorted({0, n // 2, n - 1}):
            with preserved_rng():
                seed_everything(0)
                out.append([i, content_digest(dataset[i])])
        return out
    except Exception:  # noqa: BLE001 - an iterable or lazy dataset: not compared
        return None


class LoaderWatch:
    """The loader's side of the probe; the probe's constructor sets the state it keeps.

    Example::

        class Probe(LoaderWatch): ...   # probe.batch([0, 5, 9], last=False) from rt.loader
    """

    _watching_loader: bool
    _pending: Optional[Tuple[List[int], bool]]
    _untrained: int
    _indices: List[int]
    _batch_samples: Optional[int]
    _counts: Dict[str, int]
    _after_batch: Any
    reverse: bool
    step: int

    def _write(self, record: Dict[str, Any]) -> None:
        raise NotImplementedError

    def claim_loader(self) -> bool:
        """True for the script's first ``rt.loader`` (the training data): the one whose batches
        are recorded, and split into micro-batches under ``--accum-steps``."""
        first, self._watching_loader = not self._watching_loader, True
        return first

    def loader(self, config: Dict[str, Any], dataset: Any = None) -> None:
        """``rt.loader`` says how it was built (seed, shuffle, drop_last, batch) and over
        which dataset (a few samples' checksums: every rank must hold the same one)."""
        self._write({"event": "loader", **config,
                     "contents": dataset_digests(dataset) if dataset is not None else None})

    def foreign_loader(self) -> None:
        """A DataLoader that is not ``rt.loader``'s was iterated (a sampler of the script's own)."""
        self._write({"event": "foreign_loader", "step": self.step})

    def reorder(self, batch: Any) -> Any:
        """The batch as this run feeds it: reversed when it checks the reduction order."""
        return watch.reverse_batch(batch, self._batch_samples) if self.reverse else batch

    def batch(self, indices: List[int], last: bool) -> None:
        """``rt.loader`` handed out a batch of these samples (``last``: the epoch's last). It
        counts for the step once a training forward takes it: a pass over the loader that
        trains on nothing (counting labels, statistics, a warm-up) is said, not compared."""
        if self._pending is not None:  # the batch before reached no training forward
            self._untrained += 1
            if self._pending[1]:
                self._write({"event": "untrained_pass", "step": self.step,
                             "batches": self._untrained})
                self._untrained = 0
        self._pending = ([int(i) for i in indices], last)
        self._batch_samples = len(indices)
        self._counts["batches"] += 1
        self._after_batch = watch.rng()

    def plan(self, epoch: int, indices: List[int], padding: List[int]) -> None:
        """The samples ``rt.loader`` will hand this rank in the pass now starting, as a count
        and an order-free checksum: summed over ranks, less the epoch's padding (repeats that
        even out the ranks' shares, the same list on every rank), comparable with 1 process."""
        self._write({"event": "plan", "epoch": epoch, "count": len(indices),
                     "hash": multiset_hash(indices), "padding": len(padding),
                     "padding_hash": multiset_hash(padding),
                     # the script's own generators here (verify seeded the samples' draws)
                     "streams": stream_digests()})

    def dataset_draws(self, generators: List[str]) -> None:
        """A sample's ``__getitem__`` drew from these global generators (augmentation)."""
        self._write({"event": "dataset_draws", "generators": generators})

    def _trained_on_batch(self) -> None:
        """A training forward took the batch handed out last: its samples join the step."""
        if self._pending is None:
            return
        indices, last = self._pending
        self._pending, self._untrained = None, 0
        self._indices.extend(indices)
        if last:
            self._write({"event": "epoch_end", "step": self.step})
