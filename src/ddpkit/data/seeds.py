"""Seeds for what DataLoader workers draw: per rank, worker and epoch for the worker itself, and
per batch (run seed, epoch, first sample) for what a batch's ``__getitem__`` calls draw, so a
resumed run's new workers replay the augmentation of the uninterrupted one.
"""
from __future__ import annotations

import os
import random
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.utils.data import Dataset, Sampler

try:
    import numpy as _numpy
except ImportError:  # NumPy is optional
    _numpy = None

__all__ = ["worker_seed", "sample_seed", "WorkerInit", "EpochTagged", "SeededSamples",
           "SeededEachSample"]


def worker_seed(base_seed: int, rank: int, worker_id: int, epoch: int = 0) -> int:
    """Seed for one data-loader worker: differs per rank, per worker and per epoch.

    Identical augmentation on every rank (FIELD-NOTES 3.15) wastes the extra data the ranks see.

    Example::

        worker_seed(42, rank=1, worker_id=0)
    """
    return (base_seed * 1_000_003 + rank * 10_007 + worker_id * 101 + epoch * 7_919) % (2 ** 63)


class WorkerInit:
    """Picklable worker initialiser (spawned workers need a top-level callable)."""

    def __init__(self, seed: int, rank: int, epoch: int) -> None:
        self.seed, self.rank, self.epoch = seed, rank, epoch

    def __call__(self, worker_id: int) -> None:
        s = worker_seed(self.seed, self.rank, worker_id, self.epoch)
        torch.manual_seed(s)
        random.seed(s)
        if _numpy is not None:
            _numpy.random.seed(s % (2 ** 32))
        # torchrun's agent stops a rank by signalling its process group (SIGTERM, SIGUSR1); the
        # rank then finishes its step, saves and stops (ddpkit.faults.stops), so its workers must not
        # die first (torch's worker handler would, and the rank would fail on a dead worker).
        # In a group of their own they are out of the way, and still end with the rank: it
        # stops them itself (SIGTERM from the parent), or torch's watchdog sees it gone.
        if hasattr(os, "setpgid"):
            os.setpgid(0, 0)


def sample_seed(base_seed: int, epoch: int, index: int) -> int:
    """Seed for drawing one sample's augmentation in a loader worker: a function of the run's
    seed, the epoch and the sample alone, so a resumed run (or another world size) draws the
    same for it, whichever worker fetches it and whatever that worker fetched before.

    Example::

        sample_seed(0, epoch=3, index=17)
    """
    return (base_seed * 1_000_003 + epoch * 7_919 + index * 104_729 + 1) % (2 ** 63)


class EpochTagged(Sampler[int]):
    """The sampler's indices tagged with the epoch (``epoch * n + i``) for :class:`SeededSamples`."""

    def __init__(self, sampler: Any, length: int) -> None:
        self.sampler, self.length = sampler, length

    def __iter__(self) -> Iterator[int]:
        base = self.sampler.epoch * self.length
        return (base + i for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class SeededSamples(Dataset):
    """In a worker, seeds torch, ``random`` and NumPy before fetching each batch, from
    :func:`sample_seed` of the batch's epoch and first sample: a worker's streams otherwise
    depend on everything it fetched before, which a resumed run (new workers, started
    mid-epoch) cannot replay. Once a batch, not once a sample: seeding costs ~10 us."""

    def __init__(self, dataset: Dataset, seed: int, length: int) -> None:
        self.dataset, self.seed, self.length = dataset, seed, length

    def __len__(self) -> int:
        return self.length

    def __getattr__(self, name: str) -> Any:
        # The dataset's own attributes stay reachable (get_worker_info().dataset.classes ...).
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def _seed(self, tagged: int) -> int:
        epoch, index = divmod(int(tagged), self.length)
        s = sample_seed(self.seed, epoch, index)
        # The CPU generator alone: torch.manual_seed also visits every accelerator backend
        # (~90 us a call, ~1 us this way), and a loader worker never draws on a GPU.
        torch.default_generator.manual_seed(s)
        random.seed(s)
        if _numpy is not None:
            _numpy.random.seed(s % (2 ** 32))
        return index

    def __getitem__(self, tagged: int) -> Any:
        return self.dataset[self._seed(tagged)]

    def __getitems__(self, tagged: List[int]) -> List[Any]:
        # DataLoader fetches a batch's samples through this when it exists (torch >= 2.1)
        self._seed(tagged[0])
        indices = [int(t) % self.length for t in tagged]
        batched = getattr(self.dataset, "__getitems__", None)  # e.g. Hugging Face datasets
        return list(batched(indices)) if batched else [self.dataset[i] for i in indices]


class SeededEachSample(SeededSamples):
    """Every sample's draws from its own :func:`sample_seed`, the caller's generators left as
    they were: what a sample's augmentation draws no longer depends on how the batch is split
    over ranks, so the same run at any world size (or resumed at another one) augments every
    sample alike (``rt.loader(seed_each_sample=True)``; ``ddpkit verify`` compares 1 process
    with N this way). ``on_draw``, if given, is called once, with the generators a sample's
    ``__getitem__`` drew from, the first time one does (in this process: no workers).

    Example::

        SeededEachSample(train_set, seed=0, length=len(train_set))[3 * len(train_set) + 17]
    """

    def __init__(self, dataset: Dataset, seed: int, length: int,
                 on_draw: Optional[Callable[[List[str]], None]] = None) -> None:
        super().__init__(dataset, seed, length)
        self.on_draw = on_draw

    def __getitem__(self, tagged: int) -> Any:
        if self.on_draw is None:
            return super().__getitem__(tagged)
        index = self._seed(tagged)
        seeded = _states()
        sample = self.dataset[index]
        drew = [name for name, a, b in zip(("torch", "random", "numpy"), seeded, _states())
                if not _equal(a, b)]
        if drew:
            self.on_draw(drew)
            self.on_draw = None
        return sample

    def __getitems__(self, tagged: List[int]) -> List[Any]:
        saved = (torch.random.get_rng_state(), random.getstate(),
                 _numpy.random.get_state() if _numpy is not None else None)
        try:
            return [self[t] for t in tagged]
        finally:
            torch.random.set_rng_state(saved[0])
            random.setstate(saved[1])
            if _numpy is not None:
                _numpy.random.set_state(saved[2])

    def __getstate__(self) -> Dict[str, Any]:  # to workers: the callback stays here
        return {**self.__dict__, "on_draw": None}


def _states() -> tuple:
    return (torch.random.get_rng_state(), random.getstate(),
            _numpy.random.get_state()[1].copy() if _numpy is not None else None)


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if _numpy is not None and isinstance(a, _numpy.ndarray):
        return bool((a == b).all())
    return a == b
