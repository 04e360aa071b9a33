"""What every engine does: the interface the rest of ddpkit asks (start-up, wrapping, the
optimizer, accumulation, collectives, shutdown), the defaults no engine needs to repeat, and
:class:`Reduction`, a reduction under way.

Three ideas, three classes: :class:`Engine` here (the interface), :class:`~.torchdist.TorchEngine`
(the start-up and collectives over ``torch.distributed`` that the ddp, fsdp, dp and none engines
share) and :class:`~.none.NoneEngine` (the ``none`` engine: no wrapper). Horovod's engine is an
:class:`Engine` with its own collectives (see :mod:`.horovod`).
"""
from __future__ import annotations

import abc
import contextlib
import os
import socket
from datetime import timedelta
from typing import Any, ContextManager, List, Optional, Sequence

import torch
from torch import nn

from ..faults.crash import die_with_launcher
from ..env.detect import ClusterEnv, adopt, detect
from ..base.errors import ConfigError
from ..base.wrap import WrapOptions

__all__ = ["Engine", "Reduction", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "mean", "max", "min")


class Engine(abc.ABC):
    """The interface of an engine: one way of training data-parallel.

    An engine owns everything that differs between those ways: how the process learns its place
    and joins the others, how the model is wrapped, which optimizer to step, how accumulation
    skips the gradient all-reduce, the collectives, and the shutdown. A subclass implements the
    abstract methods and overrides the defaults it does differently. Create engines with
    :func:`ddpkit.engines.create`; :func:`ddpkit.setup` picks one and keeps it on the Runtime.

    Example::

        engine = ddpkit.engines.create("none")
        model = engine.wrap(Net(), env, torch.device("cpu"), WrapOptions())
        total = engine.all_reduce(torch.tensor([3.0]), "sum")
    """

    name = ""            #: what users call it (``setup(engine=)``, ``--engine``)
    launcher = "torchrun"  #: what starts this engine's processes for `ddpkit train`

    # ------------------------------------------------------------------ start-up
    @classmethod
    def running(cls) -> bool:
        """Whether this engine's collectives serve this process now."""
        return True

    def serves(self, engine: str) -> bool:
        """Whether a script asking for ``engine`` (in ``rt.wrap``) runs on this engine as it is."""
        return engine == self.name

    def unavailable(self) -> Optional[str]:
        """Why this engine cannot run here (one line with the fix), or None."""
        return None

    def environment(self, env: Optional[ClusterEnv], argv: Sequence[str],
                    expected_world_size: Optional[int]) -> ClusterEnv:
        """This process's place in the job, from the launcher's variables (or ``env``)."""
        die_with_launcher()
        return _adopted(env or detect(os.environ, argv, expected_world_size))

    @abc.abstractmethod
    def start(self, env: ClusterEnv, device: torch.device, backend: Optional[str],
              init_method: Optional[str], timeout: timedelta) -> Optional[str]:
        """Join the other processes; returns the backend name (None for one process)."""

    def store(self) -> Any:
        """The key-value store the ranks share, or None."""
        return None

    def check_options(self, options: WrapOptions) -> None:
        """Reject wrapping options this engine cannot honour, with one line (none here)."""

    def check_world(self, world_size: int) -> None:
        """Reject a number of processes this engine cannot run, with one line (any here)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Leave the job (safe to call many times)."""

    # ------------------------------------------------------------------ model and optimizer
    @abc.abstractmethod
    def wrap(self, model: nn.Module, env: ClusterEnv, device: torch.device,
             options: WrapOptions) -> nn.Module:
        """``model`` on ``device``, wrapped as this engine trains it."""

    def optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, accum_steps: int = 1,
                  compression: Optional[str] = None) -> torch.optim.Optimizer:
        """The optimizer to step (unchanged unless the engine averages gradients in it)."""
        return optimizer

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """Context for a micro-step that must not all-reduce gradients (accumulation).

        A wrapper that reduces in backward (DDP) has ``no_sync``; anything else has nothing to
        skip."""
        skip = getattr(model, "no_sync", None)
        return skip() if callable(skip) else contextlib.nullcontext()

    def synchronized(self, optimizer: torch.optim.Optimizer) -> ContextManager[Any]:
        """Context around an optimizer step whose gradients must be averaged before clipping."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ collectives
    @abc.abstractmethod
    def rank(self) -> int:
        """Global rank of this process (0 alone)."""

    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of processes (1 alone)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait for every rank."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """A reduced copy of ``tensor`` (any device, any float dtype; ``mean`` divides); alone,
        ``tensor`` itself (a copy for ``mean``)."""

    @abc.abstractmethod
    def start_reduce(self, value: float, op: str) -> "Reduction":
        """Start reducing a number across ranks without waiting; ``.result()`` waits and gives
        it."""

    @abc.abstractmethod
    def start_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> "Reduction":
        """Start reducing a float64 tensor across ranks without waiting; ``.tensor_result()``
        waits and gives it."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's object, in rank order."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s object, on every rank."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class Reduction:
    """A reduction under way (see :meth:`Engine.start_reduce`).

    Example::

        Reduction(None, torch.tensor([3.0])).result()   # 3.0
    """

    def __init__(self, work: Any, tensor: torch.Tensor, divide: int = 1) -> None:
        self.work, self.tensor, self.divide = work, tensor, divide

    def result(self) -> float:
        """Wait for the reduction; its value."""
        return float(self.tensor_result().item())

    def tensor_result(self) -> torch.Tensor:
        """Wait for the reduction; the reduced tensor."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor / self.divide if self.divide != 1 else self.tensor


def _adopted(env: ClusterEnv) -> ClusterEnv:
    # A group made before setup (Accelerate's Accelerator, Lightning Fabric's launcher, Ray
    # Train) is the truth about the job: its rank and size win over the variables'.
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return env
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == env.world_size:
        if rank != env.rank:
            raise ConfigError(f"RANK says {env.rank}, but the process group made before "
                              f"ddpkit.setup() says {rank}: unset the stale RANK variable")
        return env
    hosts: List[Any] = [None] * world  # every rank sees the same mismatch: all gather
    dist.all_gather_object(hosts, socket.gethostname())
    return adopt(env, rank, world, hosts, os.environ)
