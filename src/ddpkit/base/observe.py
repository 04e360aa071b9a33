"""The core's one seam for a tool that watches a run from outside (``ddpkit verify``): this
process's observer, started at ``setup`` when the tool named its module in ``DDPKIT_OBSERVER``
for the processes it launched; the runtime tells it of the model, the loader of its batches. The
core never imports the tool.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Mapping, Optional

__all__ = ["OBSERVER_VAR", "active", "start", "own_directory"]

#: The observer's module (``ddpkit.verify.probe``); its ``start(rank, world_size, environ=,
#: seeded=)`` returns the observer, or None when it has nothing to watch.
OBSERVER_VAR = "DDPKIT_OBSERVER"

_ACTIVE: Optional[Any] = None


def active() -> Optional[Any]:
    """This process's observer, or None (a plain run). Example::

        watch = active()
        if watch is not None: watch.model(model)
    """
    return _ACTIVE


def start(rank: int, world_size: int, seeded: bool = True,
          environ: Optional[Mapping[str, str]] = None) -> Optional[Any]:
    """Start the observer ``DDPKIT_OBSERVER`` names (``setup`` calls this, once); else None.

    Example::

        start(env.rank, env.world_size, seeded=True)
    """
    global _ACTIVE
    environ = os.environ if environ is None else environ
    name = environ.get(OBSERVER_VAR)
    if name and _ACTIVE is None:
        _ACTIVE = importlib.import_module(name).start(rank, world_size, environ=environ,
                                                      seeded=seeded)
    return _ACTIVE


def own_directory(path: Any) -> Any:
    """Where this process keeps what ``path`` (a checkpoint directory) would hold: ``path`` in a
    plain run; under an observer that runs the script several times (``ddpkit verify``), a
    directory of this run's own, so its runs neither resume from one another nor from the
    user's real run, and leave nothing behind.

    Example::

        directory = own_directory("runs/lm/checkpoints")   # the same path in a plain run
    """
    redirect = getattr(_ACTIVE, "own_directory", None)
    return path if path is None or redirect is None else redirect(path)
