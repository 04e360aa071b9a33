"""Engines: one object per way of training data-parallel, chosen once by :func:`ddpkit.setup`.

``ddp`` (DistributedDataParallel), ``fsdp`` (FSDP2, sharded), ``dp`` (DataParallel), ``horovod``
and ``none`` (no wrapper). The rest of ddpkit asks the engine (wrap, optimizer, no_sync,
collectives, shutdown) and never which engine it is; adding an engine means adding a module here
and a line to ``_ENGINES``.
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Type

import torch
from torch import nn

from ..env.detect import ClusterEnv
from ..base.errors import ConfigError
from ..base.wrap import WrapOptions
from .base import Engine
from .ddp import DDPEngine
from .dp import DPEngine
from .fsdp import FSDPEngine
from .horovod import HorovodEngine, started_by_horovod
from .live import LIVE_VAR, LiveEngine
from .none import NoneEngine
from .torchdist import TorchEngine

__all__ = ["Engine", "TorchEngine", "NoneEngine", "ENGINES", "create", "choose", "active",
           "wrap_model"]

# The order is the one users see in error messages and --help.
_ENGINES: Dict[str, Type[Engine]] = {"ddp": DDPEngine, "fsdp": FSDPEngine, "dp": DPEngine,
                                     "horovod": HorovodEngine, "none": NoneEngine}
ENGINES = tuple(_ENGINES)
# Engines whose collectives replace torch.distributed's when they run (checked in this order).
_COLLECTIVES = (HorovodEngine, LiveEngine)


def create(name: str) -> Engine:
    """A new engine by its name (``ddp``, ``fsdp``, ``dp``, ``horovod``, ``none``).

    Example::

        engine = create("ddp")
    """
    if name == "live":  # not a choice: what `ddpkit run --fault-tolerant` starts its replicas on
        return LiveEngine()
    if name not in _ENGINES:
        raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    return _ENGINES[name]()


def choose(name: str = "auto", environ: Mapping[str, str] = os.environ) -> Engine:
    """The engine ``setup(engine=name)`` runs: ``auto`` is Horovod in a process started by
    ``horovodrun``, DDP otherwise; ``torch`` is the old name of ``ddp``.

    Example::

        choose("auto", {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}).name   # 'horovod'
    """
    if name == "torch":
        name = "ddp"
    if environ.get(LIVE_VAR) == "1":  # a replica of `ddpkit run --fault-tolerant`
        if name not in ("auto", "ddp", "live"):
            raise ConfigError(f"engine {name!r} cannot run fault-tolerant: each replica holds "
                              "the whole model (engine ddp); leave --fault-tolerant out to "
                              f"use {name}")
        return LiveEngine()
    if name == "auto":
        name = "horovod" if started_by_horovod(environ) else "ddp"
    if name not in _ENGINES:
        raise ConfigError(f"unknown engine {name!r}; choose one of auto, {', '.join(ENGINES)}")
    return _ENGINES[name]()


_TORCH = NoneEngine()  # torch.distributed's collectives, for code that runs under no engine


def active() -> Engine:
    """The engine whose collectives serve this process now: Horovod's after ``hvd.init()`` on
    several processes, torch.distributed's otherwise (one-process answers without a group).

    Example::

        total = active().all_reduce(torch.tensor([2.0]), "sum")
    """
    for cls in _COLLECTIVES:
        if cls.running():
            return cls()
    return _TORCH


def wrap_model(model: nn.Module, env: ClusterEnv, device: torch.device, engine: str = "ddp",
               options: Optional[WrapOptions] = None) -> nn.Module:
    """Move ``model`` to ``device`` and wrap it for ``engine``; with one process ``ddp`` is a no-op.

    Example::

        model = wrap_model(Net(), env, device, "ddp", WrapOptions(sync_bn=True))
    """
    return create(engine).wrap(model, env, device, options or WrapOptions())
