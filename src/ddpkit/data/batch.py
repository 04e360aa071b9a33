"""The one batch-size rule: a batch size is the **global batch of one optimizer step**, the samples
every rank's micro-batches of that step hold together; each rank's micro-batch is
``batch_size / (world_size x accum_steps)``. ``rt.loader(batch_size=, accum_steps=)``,
``ddpkit train --batch-size --accum-steps`` and the bench split a batch here, and refuse one
that does not split here, with sizes that do. :class:`Batch` is the split, decided once: the
loader carries it (``loader.batch``) and what reports or records a batch reads it.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from ..base.errors import ConfigError

__all__ = ["Spelling", "PYTHON", "split_batch", "good_sizes", "Batch"]


@dataclass(frozen=True)
class Spelling:
    """How a refusal names the numbers: ``batch_size=256`` in Python, ``--batch-size 256`` on
    the command line.

    Example::

        split_batch(10, 4, names=Spelling("--batch-size", "--accum-steps", None, " "))
    """

    batch: str = "batch_size"
    accum: str = "accum_steps"
    per_rank: Optional[str] = "per_rank_batch"  #: the other way to give it, if there is one
    sep: str = "="  #: between a name and its value

    def of(self, name: str, value: object) -> str:
        """``name`` given ``value``: ``batch_size=8``, ``--batch-size 8``."""
        return f"{name}{self.sep}{value}"


PYTHON = Spelling()


def good_sizes(batch: int, unit: int, samples: Optional[int] = None) -> str:
    """The multiples of ``unit`` nearest to ``batch`` (at most ``samples``): 'A or B', or 'A'.

    Example::

        good_sizes(10, 4)   # '8 or 12'
    """
    top = samples if samples is not None else max(batch, unit) + unit
    below = min(batch, top) // unit * unit
    above = below + unit
    sizes = [size for size in (below, above) if unit <= size <= top]
    return " or ".join(str(size) for size in sizes)


def split_batch(batch_size: int, world_size: int, accum_steps: int = 1,
                names: Spelling = PYTHON, most: Optional[int] = None) -> int:
    """Each rank's micro-batch for a global batch of ``batch_size`` per optimizer step over
    ``world_size`` processes and ``accum_steps`` micro-steps; a :class:`ConfigError` of one
    line, naming sizes that split (at most ``most``: the samples there are), when it does not
    split evenly.

    Example::

        split_batch(256, 4)                  # 64
        split_batch(256, 4, accum_steps=2)   # 32: two micro-batches of 32 a rank per step
    """
    if batch_size < 1:
        raise ConfigError(f"{names.batch} must be >= 1, got {batch_size}")
    if accum_steps < 1:
        raise ConfigError(f"{names.accum} must be >= 1, got {accum_steps}")
    unit = world_size * accum_steps
    if batch_size % unit == 0:
        return batch_size // unit
    split = f"{world_size} process{'es' if world_size != 1 else ''}" + (
        f" x {accum_steps} accumulation steps" if accum_steps > 1 else "")
    why = f"{names.of(names.batch, batch_size)} cannot be split evenly over {split}"
    if accum_steps > 1 and batch_size % world_size == 0:
        why = (f"{names.of(names.accum, accum_steps)} cannot split the per-process batch "
               f"{batch_size // world_size} (global {batch_size} / {world_size} processes)")
    other = f", or give {names.per_rank}= a rank's own batch" if names.per_rank else ""
    sizes = names.of(names.batch, good_sizes(batch_size, unit, most))
    raise ConfigError(f"{why}; use {sizes}{other}")


@dataclass(frozen=True)
class Batch:
    """One optimizer step's batch, decided and checked once (:meth:`of`): the ``global_batch``
    of the step over ``world_size`` ranks, each rank taking ``accum_steps`` micro-batches of
    ``micro_batch`` samples (``global_batch == micro_batch x world_size x accum_steps``).
    ``rt.loader`` carries it as ``loader.batch``; the progress line, checkpoints, the resume
    line, ``ddpkit verify`` and ``ddpkit bench`` read it. ``per_rank`` is a rank's samples per
    optimizer step, ``per_micro_step`` the samples of one micro-step over all ranks.

    Example::

        b = Batch.of(256, world_size=4, accum_steps=2)
        (b.micro_batch, b.per_rank, b.per_micro_step)   # (32, 64, 128)
        Batch.of(0, 4, per_rank_batch=32).global_batch  # 128: a rank's micro-batch given
    """

    global_batch: int
    world_size: int
    accum_steps: int
    micro_batch: int

    def __post_init__(self) -> None:
        for name in ("global_batch", "world_size", "accum_steps", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))  # a NumPy integer kept as a plain int
        if self.global_batch != self.micro_batch * self.world_size * self.accum_steps:
            raise ConfigError(f"a global batch of {self.global_batch} is not {self.micro_batch} "
                              f"a micro-batch x {self.world_size} rank(s) x {self.accum_steps} "
                              f"accumulation step(s)")

    @classmethod
    def of(cls, batch_size: int, world_size: int, accum_steps: int = 1, *,
           per_rank_batch: Optional[int] = None, names: Spelling = PYTHON,
           most: Optional[int] = None) -> "Batch":
        """The step's batch from its global ``batch_size`` split by :func:`split_batch` (its
        one-line :class:`ConfigError` when it does not split), or from ``per_rank_batch``, a
        rank's micro-batch (``batch_size`` then unused): the global batch is what it makes.

        Example::

            Batch.of(16, world_size=1, accum_steps=4)        # micro-batches of 4, global 16
            Batch.of(0, 2, accum_steps=4, per_rank_batch=3)   # global 24
        """
        if per_rank_batch is None:
            micro = split_batch(batch_size, world_size, accum_steps, names, most)
        else:
            if not isinstance(per_rank_batch, int) or per_rank_batch < 1:
                raise ConfigError(f"{names.per_rank or 'per_rank_batch'} must be >= 1, got "
                                  f"{per_rank_batch!r}")
            if accum_steps < 1:
                raise ConfigError(f"{names.accum} must be >= 1, got {accum_steps}")
            micro = per_rank_batch
        return cls(micro * world_size * accum_steps, world_size, accum_steps, micro)

    @property
    def per_rank(self) -> int:
        """A rank's samples in one optimizer step: its ``accum_steps`` micro-batches."""
        return self.micro_batch * self.accum_steps

    @property
    def per_micro_step(self) -> int:
        """The samples of one micro-step over all ranks (what one loader batch is, globally)."""
        return self.micro_batch * self.world_size

    def as_dict(self) -> Dict[str, int]:
        """The four numbers, as a checkpoint's progress records them.

        Example::

            Batch.of(16, 1, 4).as_dict()
            # {'global_batch': 16, 'world_size': 1, 'accum_steps': 4, 'micro_batch': 4}
        """
        return {"global_batch": self.global_batch, "world_size": self.world_size,
                "accum_steps": self.accum_steps, "micro_batch": self.micro_batch}

    @classmethod
    def recorded(cls, progress: Mapping[str, Any]) -> Optional["Batch"]:
        """The batch a checkpoint's ``progress`` records, or None where it records none whole
        (a checkpoint written before the batch was recorded: its ``global_batch`` alone was a
        micro-batch x the world size, without accumulation).

        Example::

            Batch.recorded({"batch": Batch.of(16, 1, 4).as_dict()}).micro_batch   # 4
            Batch.recorded({"global_batch": 4})                                   # None
        """
        said = progress.get("batch")
        if not isinstance(said, Mapping):
            return None
        try:
            return cls(**{k: int(said[k]) for k in ("global_batch", "world_size", "accum_steps",
                                                    "micro_batch")})
        except (KeyError, TypeError, ValueError, ConfigError):
            return None
