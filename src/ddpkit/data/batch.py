"""The one batch-size rule: a batch size is the **global batch of one optimizer step**, the samples
every rank's micro-batches of that step hold together; each rank's micro-batch is
``batch_size / (world_size x accum_steps)``. ``rt.loader(batch_size=, accum_steps=)``,
``ddpkit train --batch-size --accum-steps`` and the bench split a batch here, and refuse one
that does not split here, with sizes that do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..base.errors import ConfigError

__all__ = ["Spelling", "PYTHON", "split_batch", "good_sizes"]


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
