"""Data loading for N ranks: the global batch split across ranks, epochs owned by the loader.

``DistributedLoader`` calls ``set_epoch`` itself on every new pass (it cannot be forgotten), can
resume in the middle of an epoch, and seeds each batch its workers fetch from (seed, epoch, batch).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, Iterator, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ..base import observe
from ..env.detect import ClusterEnv
from ..base.errors import ConfigError
from .seeds import (EpochTagged, SeededEachSample, SeededSamples, WorkerInit, sample_seed,
                           worker_seed)
from .batch import Batch
from .resident import ResidentData, batches_in, choose_resident, resident_batches


__all__ = ["ResumableSampler", "MicroStepSampler", "ShardSampler",
           "DistributedLoader", "make_loader", "worker_seed", "sample_seed"]


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start an epoch after the first ``n`` samples *globally*.

    Shards are interleaved (rank r takes positions r, r+N, ...), so after k batches of b on each
    of N ranks exactly the first N*k*b positions of the epoch's permutation are consumed, whatever
    N was. Skipping that prefix resumes an epoch exactly, even on a different number of ranks.
    With nothing skipped the order is identical to ``DistributedSampler``'s.

    Example::

        sampler = ResumableSampler(ds, num_replicas=2, rank=0, seed=1)
        sampler.set_epoch(3); sampler.skip(256)   # continue epoch 3 after 256 samples
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start = self.pad_base = 0

    def skip(self, samples: int, pad_base: Optional[int] = None) -> None:
        """Skip the first ``samples`` positions of the current epoch across all ranks (once).

        The epoch is padded (to a multiple of the ranks) from position ``pad_base`` on: 0 when
        the skipped part was consumed by as many ranks as this sampler has, so the rest, padding
        included, is exactly what an uninterrupted run sees; ``samples`` (the default) after a
        change of the world size, so nothing consumed is repeated as padding."""
        self.start = samples
        self.pad_base = samples if pad_base is None else min(pad_base, samples)

    def _epoch_indices(self) -> list:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def _padded(self, indices: list) -> list:
        world = self.num_replicas
        if self.drop_last:
            return indices[: len(indices) // world * world]
        pad = (-len(indices)) % world
        if pad and indices:
            indices = indices + (indices * math.ceil(pad / len(indices)))[:pad]
        return indices

    def _remaining(self, indices: list) -> list:
        rest = self._padded(indices[self.pad_base:])[self.start - self.pad_base:]
        if len(rest) % self.num_replicas:  # never uneven shards (a position from an old format)
            rest = self._padded(indices[self.start:])
        return rest

    def __iter__(self) -> Iterator[int]:
        epoch = self._epoch_indices()
        indices = self._remaining(epoch)
        pad = max(0, len(indices) - (len(epoch) - self.start))
        self.start = self.pad_base = 0
        self.last_indices = self._shard(indices)  # what ddpkit verify records
        self.last_padding = indices[len(indices) - pad:] if pad else []  # the same on every rank
        return iter(self.last_indices)

    def _shard(self, indices: list) -> list:
        """This rank's positions of the (padded) epoch."""
        return indices[self.rank::self.num_replicas]

    def __len__(self) -> int:
        n = len(self.dataset)  # type: ignore[arg-type]
        return len(self._remaining(list(range(n)))) // self.num_replicas


class MicroStepSampler(ResumableSampler):
    """One process taking, step after step, the batches of ``num_replicas`` ranks in rank order
    (``ddpkit verify --accum-steps K``: accumulating K micro-batches is then the K ranks' step).

    Example::

        list(MicroStepSampler(range(8), micro_batch=2, num_replicas=2, rank=0, shuffle=False))
        # [0, 2, 1, 3, 4, 6, 5, 7]: rank 0's batch, rank 1's batch, then the next step's
    """

    def __init__(self, *args: Any, micro_batch: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch = micro_batch  # num_samples stays one rank's: len(loader) is in steps

    def _shard(self, indices: list) -> list:
        shards, b = [indices[k::self.num_replicas] for k in range(self.num_replicas)], \
            self.micro_batch
        return [i for t in range(0, len(shards[0]), b) for s in shards for i in s[t:t + b]]

    def __len__(self) -> int:
        return super().__len__() * self.num_replicas


class ShardSampler(Sampler[int]):
    """Every index exactly once across ranks, in order, no padding (for exact evaluation).

    Rank r gets a contiguous block; blocks differ in length by at most one sample.

    Example::

        list(ShardSampler(7, num_replicas=3, rank=0))   # [0, 1, 2]
    """

    def __init__(self, length: int, num_replicas: int = 1, rank: int = 0) -> None:
        base, extra = divmod(length, num_replicas)
        self.begin = rank * base + min(rank, extra)
        self.end = self.begin + base + (1 if rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.begin, self.end))

    def __len__(self) -> int:
        return self.end - self.begin


class DistributedLoader:
    """A DataLoader over this rank's share of the data whose every pass is the next epoch.

    Iterating the loader calls ``sampler.set_epoch(epoch)`` first, so shuffling differs each
    epoch without user code. ``state_dict`` / ``load_state_dict`` record the epoch and the
    number of batches already consumed, so a resumed run continues with the very next sample.
    ``batch_size`` is torch's: this rank's micro-batch; ``batch`` is the optimizer step's
    (:class:`~ddpkit.data.batch.Batch`: global batch, world size, accumulation steps, micro-batch).

    Example::

        loader = make_loader(dataset, batch_size=256, env=env)
        loader.batch.global_batch, loader.batch_size   # 256, and 256 / world size a rank
        for epoch in range(10):
            for x, y in loader:      # set_epoch(epoch) was called for you
                ...
    """

    def __init__(self, dataset: Dataset, sampler: ResumableSampler, batch_size: int,
                 loader_kwargs: Dict[str, Any], seed: int, rank: int,
                 resident: Optional[ResidentData] = None) -> None:
        #: as in torch's DataLoader: the samples of one batch it gives, this rank's micro-batch
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        #: the optimizer step's batch (:class:`~ddpkit.data.batch.Batch`), set by make_loader;
        #: built by hand, a loader's batch is one micro-batch a rank, no accumulation
        self.batch = Batch(batch_size * sampler.num_replicas, sampler.num_replicas, 1, batch_size)
        #: The data on the device (:mod:`ddpkit.data.resident`), or None: the DataLoader path.
        self.resident = resident
        self.loader_kwargs, self.seed, self.rank = loader_kwargs, seed, rank
        self.epoch = -1          # epoch of the pass in progress (or last finished)
        self.batches_done = 0    # batches handed out in this pass
        self._skip_samples = 0   # global samples of this epoch skipped at the start of the pass
        self._pad_base = 0       # where this pass's padding is computed from (ResumableSampler.skip)
        self._resume: Optional[Dict[str, int]] = None
        self._loader: Optional[DataLoader] = None
        self._generator = torch.Generator()
        self._finished = False   # the pass ran to its end (the next pass is the next epoch)
        self.pass_batches = len(self)  # batches in the pass in progress (less after a resume)
        self.watched = False     # its batches are what ddpkit verify records
        #: every sample's random draws from its own seed (run seed, epoch, sample): the same
        #: augmentation at any world size (make_loader's ``seed_each_sample``)
        self.seed_each_sample = False

    def __len__(self) -> int:
        """Batches per rank in a full epoch."""
        return batches_in(self.sampler.num_samples, self.batch_size,
                          self.loader_kwargs.get("drop_last", False))

    def _dataloader(self) -> DataLoader:
        # The iterator's base seed comes from a generator of the loader's own, seeded by
        # (seed, rank, epoch): drawn from the global RNG it would shift every later draw of a
        # resumed run (augmentation in __getitem__, dropout) against the uninterrupted one.
        self._generator.manual_seed(worker_seed(self.seed, self.rank, 0, self.epoch))
        if self._loader is not None:
            return self._loader
        # With workers, each batch is drawn from its own seed (see ddpkit.data.seeds); the
        # sampler always runs in this process, so set_epoch reaches it either way, and
        # persistent workers (the default when num_workers > 0) keep serving later epochs.
        # Under ddpkit verify every sample draws from its own seed, so augmentation does not
        # depend on how a batch is split over ranks.
        watch = observe.active()
        each = self.seed_each_sample or watch is not None
        workers = self.loader_kwargs.get("num_workers", 0)
        tagged = workers > 0 or each
        n = len(self.dataset)  # type: ignore[arg-type]
        on_draw = getattr(watch, "dataset_draws", None) if self.watched and not workers else None
        data = (SeededEachSample(self.dataset, self.seed, n, on_draw) if each else
                SeededSamples(self.dataset, self.seed, n)) if tagged else self.dataset
        loader = DataLoader(data,
                            batch_size=self.batch_size,
                            sampler=EpochTagged(self.sampler, n) if tagged else self.sampler,
                            worker_init_fn=WorkerInit(self.seed, self.rank, self.epoch),
                            generator=self._generator, **self.loader_kwargs)
        loader._ddpkit_owned = True  # type: ignore[attr-defined]  (not "a loader of the script's own")
        if self.loader_kwargs.get("persistent_workers"):
            self._loader = loader
        return loader

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        if resume is not None:
            self.epoch, self._skip_samples = resume["epoch"], resume["samples_done"]
            same_world = resume.get("world_size", self.sampler.num_replicas) == \
                self.sampler.num_replicas
            self._pad_base = resume.get("pad_base", 0) if same_world else self._skip_samples
        else:
            self.epoch, self._skip_samples, self._pad_base = self.epoch + 1, 0, 0
        self.batches_done, self._finished = 0, False
        self.sampler.set_epoch(self.epoch)
        self.sampler.skip(self._skip_samples, self._pad_base)
        drop = self.loader_kwargs.get("drop_last", False)
        self.pass_batches = batches_in(len(self.sampler), self.batch_size, drop)
        batches = (resident_batches(self.resident, list(self.sampler), self.batch_size, drop,
                                    self.epoch, self.seed)
                   if self.resident is not None else self._dataloader())
        watch = observe.active() if self.watched else None
        for batch in batches:
            self.batches_done += 1
            if watch is not None:  # ddpkit verify: which samples, and another reduction order
                batch = self._watched(watch, batch)
            yield batch
        self._finished = True

    def _watched(self, watch: Any, batch: Any) -> Any:
        end = self.batches_done * self.batch_size
        if self.batches_done == 1:  # the samples this pass hands out, drop_last's cut included
            planned = self.sampler.last_indices
            if self.loader_kwargs.get("drop_last"):
                planned = planned[:len(planned) // self.batch_size * self.batch_size]
            watch.plan(self.epoch, planned, self.sampler.last_padding)
        watch.batch(self.sampler.last_indices[end - self.batch_size:end],
                    last=self.batches_done == self.pass_batches)
        return watch.reorder(batch)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``, from its start; a resume into that same epoch
        keeps its place (a loop that calls ``set_epoch`` itself, like a script written for
        ``DistributedSampler``, still continues mid-epoch).

        Example::

            loader.set_epoch(5)
        """
        if self._resume is not None and self._resume["epoch"] == epoch:
            return
        if self._resume is not None and self._resume.get("restored"):
            warnings.warn(f"set_epoch({epoch}) drops the resumed position (epoch "
                          f"{self._resume['epoch']}, {self._resume['samples_done']} samples "
                          "done): start the loop at ckpt.epoch (rt.checkpointer) to continue "
                          "where the run stopped", stacklevel=2)
        self._resume = {"epoch": epoch, "samples_done": 0, "pad_base": 0}

    def end_pass(self) -> None:
        """Count the pass as over once its last batch is handed out, though the ``for`` loop left
        before asking for more (a ``break`` on the last step): a checkpoint saved after the
        epoch's own end (evaluation, a per-epoch schedule) then resumes with the next epoch,
        not with an empty pass of this one that would run that end again.

        Example::

            for x, y in loader:
                ...
                if step == max_steps: break
            loader.end_pass()   # epoch over if that was its last batch
        """
        if self.epoch >= 0 and self._resume is None and self.at_last_batch:
            self._finished = True

    @property
    def at_last_batch(self) -> bool:
        """True while the batch just handed out is the last of this pass."""
        return self.batches_done >= self.pass_batches

    @property
    def _samples_done(self) -> int:
        return self._skip_samples + self.batches_done * self.batch_size * self.sampler.num_replicas

    def state_dict(self) -> Dict[str, int]:
        """Position in the data: the epoch the next batch belongs to and the samples of it
        already consumed, globally (a finished pass: the next epoch, from 0).

        Example::

            state = loader.state_dict()   # {'epoch': 2, 'samples_done': 2176, ...}
        """
        world = self.sampler.num_replicas
        if self._resume is not None:
            state = {k: v for k, v in self._resume.items() if k != "restored"}
        elif self._finished or self.epoch < 0:
            state = {"epoch": self.epoch + 1, "samples_done": 0, "pad_base": 0}
        else:
            state = {"epoch": self.epoch, "samples_done": self._samples_done,
                     "pad_base": self._pad_base}
        return {"pad_base": 0, "world_size": world, **state, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continue at ``state``'s position on the next pass, on any number of ranks.

        Example::

            loader.load_state_dict(checkpoint["loader"])
        """
        if state.get("seed", self.seed) != self.seed:
            raise ConfigError(f"checkpoint was shuffled with seed {state['seed']}, this run "
                              f"uses {self.seed}; resume with the same seed")
        self._resume = {"epoch": int(state["epoch"]), "samples_done": int(state["samples_done"]),
                        "pad_base": int(state.get("pad_base", 0)),
                        "world_size": int(state.get("world_size", self.sampler.num_replicas)),
                        "restored": True}


#: DataLoader arguments the loader sets itself, and why.
_OWNED = {
    "sampler": "it shards and shuffles with its own resumable sampler (use shuffle=, seed=, "
               "drop_last=)",
    "batch_sampler": "it batches its own sampler's shard (use batch_size=, drop_last=)",
    "generator": "it seeds its DataLoader from seed= (per epoch, so a resume replays it; use seed=)",
    "worker_init_fn": "it seeds every worker and every batch from seed= (use seed=)",
}


def _refuse_owned(loader_kwargs: Dict[str, Any]) -> None:
    for key in loader_kwargs:
        if _OWNED.get(key):
            raise ConfigError(f"rt.loader does not take {key}=: {_OWNED[key]}")


def make_loader(dataset: Dataset, batch_size: int, env: ClusterEnv, *, accum_steps: int = 1,
                per_rank_batch: Optional[int] = None, shuffle: bool = True,
                drop_last: bool = False, seed: int = 0, num_workers: int = 0,
                persistent_workers: bool = True, device: Optional[torch.device] = None,
                collate_fn: Optional[Callable] = None, resident: Union[str, bool] = "auto",
                seed_each_sample: bool = False, **loader_kwargs: Any) -> DistributedLoader:
    """Build the training loader from the *global* batch of one optimizer step (or an explicit
    per-rank micro-batch): each batch it gives is one micro-batch of
    ``batch_size / (world size x accum_steps)`` samples (see :mod:`ddpkit.data.batch`).

    ``resident`` puts the data on ``device`` and gathers each batch there (see
    :mod:`ddpkit.data.resident`): ``"auto"`` does so on a GPU when the dataset supports it and fits
    in a quarter of the free memory, ``True`` always (CPU too), ``False`` never. Resident data
    ignores ``num_workers`` and ``collate_fn``; the sampler, epochs and resume are the same.

    ``seed_each_sample=True`` draws every sample's augmentation (torch, ``random`` and NumPy in
    ``__getitem__``) from a seed of its own (run seed, epoch, sample), the caller's generators
    left as they were: each sample is augmented alike on any number of processes (and after
    a resume at another world size), with or without workers. It costs a seeding per sample
    (about 23 us a sample here: benchmarks/seed_each_sample.py); by default what a sample draws
    depends on the samples fetched before it (each batch seeded once in a worker; one stream
    per rank without workers).

    Example::

        loader = make_loader(train_set, batch_size=256, env=env, seed=0, num_workers=2)
        len(loader)   # batches per rank per epoch
        make_loader(train_set, 256, env, seed_each_sample=True)   # the same at any world size
    """
    batch = Batch.of(batch_size, env.world_size, accum_steps, per_rank_batch=per_rank_batch)
    per_rank = batch.micro_batch
    if num_workers < 0:
        raise ConfigError(f"number of loader workers must be >= 0, got {num_workers}")
    watch = observe.active()
    watch = watch if watch is not None and watch.claim_loader() else None  # the training data
    micro = watch.accum if watch is not None and env.world_size == 1 else 1
    if micro > 1:  # ddpkit verify --accum-steps: 1 process takes K ranks' batches in turn
        if per_rank % micro:
            raise ConfigError(f"--accum-steps {micro} does not divide the script's batch of "
                              f"{per_rank}: pass --accum-steps equal to --nproc, a divisor "
                              f"of {per_rank}")
        per_rank //= micro  # the step's batch is the same, taken as micro x more micro-batches
        batch = Batch(batch.global_batch, 1, batch.accum_steps * micro, per_rank)
        sampler: ResumableSampler = MicroStepSampler(
            dataset, num_replicas=micro, rank=0, shuffle=shuffle, seed=seed,
            drop_last=drop_last, micro_batch=per_rank)
    else:
        sampler = ResumableSampler(dataset, num_replicas=env.world_size, rank=env.rank,
                                   shuffle=shuffle, seed=seed, drop_last=drop_last)
    _refuse_owned(loader_kwargs)
    kwargs = dict(num_workers=num_workers, drop_last=drop_last, collate_fn=collate_fn,
                  persistent_workers=persistent_workers and num_workers > 0,
                  pin_memory=device is not None and device.type == "cuda")
    kwargs.update(loader_kwargs)  # e.g. pin_memory=False, prefetch_factor=4
    data = choose_resident(dataset, device or torch.device("cpu"), resident) \
        if collate_fn is None or resident is True else None
    loader = DistributedLoader(dataset, sampler, per_rank, kwargs, seed, env.rank, data)
    loader.batch = batch
    loader.watched = watch is not None
    loader.seed_each_sample = seed_each_sample
    _check_not_empty(loader, len(dataset), batch.global_batch,  # type: ignore[arg-type]
                     env.world_size)
    if watch is not None:  # ddpkit verify: how the loader was asked for
        watch.loader({"seed": seed, "shuffle": shuffle, "drop_last": drop_last,
                      "batch_per_rank": per_rank, "samples": len(dataset),  # type: ignore
                      "batches": len(loader), "micro_steps": micro,
                      "global_batch": batch.global_batch, "batch": batch.as_dict(),
                      "seed_each_sample": seed_each_sample, "num_workers": num_workers},
                     dataset)
    return loader


def _check_not_empty(loader: DistributedLoader, samples: int, batch: int, world: int) -> None:
    # Training on no batch would "finish" at once with a loss of 0: say so instead.
    if samples == 0:
        raise ConfigError("rt.loader: the dataset has 0 samples; check the data you pass")
    if len(loader) == 0:
        raise ConfigError(f"rt.loader: {samples} samples on {world} rank(s) with a global batch "
                          f"of {batch} and drop_last=True give no batch; use a batch of at most "
                          f"{samples // world * world or world} or drop_last=False")
