"""The checks of :class:`~ddpkit.checkpoint.checkpointer.Checkpointer`'s arguments: each wrong
one refused in one line, before anything is saved or restored.

Example::

    check_options(every_steps=200, every_minutes=0, keep=3, extra={"best": 0.0}, mtbf_hours=24)
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from ..engines import comm
from ..base.errors import ConfigError

__all__ = ["check_options", "check_extra_names", "check_parts", "check_same_on_every_rank",
           "RESERVED"]

# Names the checkpoint itself uses: extras cannot take them.
RESERVED = frozenset({"model", "optimizer", "scheduler", "precision", "scaler", "loader",
                      "progress", "rng", "world_size", "config", "meta", "sharded",
                      "extra_names", "extra_per_rank"})


def check_options(every_steps: Any, every_minutes: Any, keep: Any,
                  extra: Optional[Mapping[str, Any]], mtbf_hours: Any) -> None:
    """The cadence, ``keep``, ``mtbf_hours`` and the extras' names, or a :class:`ConfigError`."""
    if every_steps != "auto" and (isinstance(every_steps, bool) or
                                  not isinstance(every_steps, int) or every_steps < 0):
        raise ConfigError(f"every_steps must be an integer >= 0 (0: off) or 'auto', got "
                          f"{every_steps!r}")
    if isinstance(mtbf_hours, bool) or not isinstance(mtbf_hours, (int, float)) or \
            not 0 < mtbf_hours < float("inf"):  # a positive finite number of hours
        raise ConfigError(f"mtbf_hours must be hours > 0 between failures, got {mtbf_hours!r}")
    if not isinstance(every_minutes, (int, float)) or every_minutes < 0:
        raise ConfigError(f"every_minutes must be a number >= 0 (0: off), got {every_minutes!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep must be an integer >= 1 (checkpoints to keep), got {keep!r}")
    check_extra_names(extra or {})


def check_extra_names(extra: Mapping[str, Any]) -> None:
    """Refuse extras named like a part of the checkpoint (checked again at each save)."""
    clash = sorted(set(extra) & RESERVED)
    if clash:
        raise ConfigError(f"extra names {clash} are taken by the checkpoint itself; rename them "
                          f"(reserved: {', '.join(sorted(RESERVED))})")


def check_parts(model: Any, loader: Any) -> None:
    """A module to save, and a loader that knows its place in the epoch (or none)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model= must be the nn.Module you train, got {type(model).__name__}")
    if loader is not None and not all(hasattr(loader, a) for a in
                                      ("state_dict", "load_state_dict", "at_last_batch")):
        raise ConfigError(f"loader= must be a loader from rt.loader(...) (it knows its place in "
                          f"the epoch), got {type(loader).__name__}; build it with rt.loader, or "
                          "leave loader= out and keep the position in extra=")


def check_same_on_every_rank(directory: Any) -> None:
    """A directory on every rank or on none (a collective): saving and resuming are
    collectives, so a directory on rank 0 only would hang the others."""
    given = comm.gather_object(directory is not None)
    if len(set(given)) > 1:
        raise ConfigError("rt.checkpointer(directory=...) was given on some ranks and None on "
                          "others; give the same directory on every rank (rank 0 alone writes)")
