"""What every engine does, and how a torch engine does it: the start-up, the collectives over
``torch.distributed`` (or the one-process answer without a group), and no wrapping at all.

An engine owns everything that differs between ways of training data-parallel: how the
process learns its place and joins the others, how the model is wrapped, which optimizer to
step, how accumulation skips the gradient all-reduce, the collectives, and the shutdown.
Subclasses override only what they do differently (see :mod:`.ddp`, :mod:`.dp`, :mod:`.horovod`).
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, ContextManager, List, Optional, Sequence

import torch
import torch.distributed as tdist
from torch import nn

from ..faults.crash import die_with_launcher
from ..env.dist import init_process_group, shutdown
from ..env.detect import ClusterEnv, detect
from ..wrap import WrapOptions

__all__ = ["Engine", "Reduction", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "mean", "max", "min")
_TORCH_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN,
              "mean": tdist.ReduceOp.SUM}


class Engine:
    """The ``none`` engine: torch.distributed collectives, the model left unwrapped.

    Also the base of every engine: override what differs. Create engines with
    :func:`ddpkit.engines.create`; :func:`ddpkit.setup` picks one and keeps it on the Runtime.

    Example::

        engine = ddpkit.engines.create("none")
        model = engine.wrap(Net(), env, torch.device("cpu"), WrapOptions())
        total = engine.all_reduce(torch.tensor([3.0]), "sum")
    """

    name = "none"
    launcher = "torchrun"  # what starts this engine's processes for `ddpkit train`

    # ------------------------------------------------------------------ start-up
    @classmethod
    def running(cls) -> bool:
        """Whether this engine's collectives serve this process now (torch: always; alone,
        they answer for one process)."""
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
        return env or detect(os.environ, argv, expected_world_size)

    def start(self, env: ClusterEnv, device: torch.device, backend: Optional[str],
              init_method: Optional[str], timeout: timedelta) -> Optional[str]:
        """Join the other processes; returns the backend name (None for one process).

        Also a small gloo group of the same ranks for the loop's own questions (is a stop
        requested?): CPU numbers, no device sync, and a question still in flight when a peer
        hangs times out there, not in the training's collectives."""
        name = init_process_group(env, device, backend, init_method, timeout)
        if name is not None and self._group():
            self._side = tdist.new_group(backend="gloo", timeout=timeout)
        return name

    def store(self) -> Any:
        """The key-value store the ranks share (the rendezvous store), or None."""
        if not self._group():
            return None
        try:
            return tdist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError):  # a private helper of torch: may move
            return None

    def check_options(self, options: WrapOptions) -> None:
        """Reject wrapping options this engine cannot honour, with one line (none here)."""

    def check_world(self, world_size: int) -> None:
        """Reject a number of processes this engine cannot run, with one line (any here)."""

    # ------------------------------------------------------------------ model and optimizer
    def wrap(self, model: nn.Module, env: ClusterEnv, device: torch.device,
             options: WrapOptions) -> nn.Module:
        """Move ``model`` to ``device``; the torch engines wrap it further."""
        self.check_options(options)
        return model.to(device)

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

    def shutdown(self) -> None:
        """Leave the job: destroy the process group (safe to call many times)."""
        shutdown()

    # ------------------------------------------------------------------ collectives
    @staticmethod
    def _group() -> bool:
        return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1

    def rank(self) -> int:
        """Global rank of this process (0 alone)."""
        return tdist.get_rank() if self._group() else 0

    def world_size(self) -> int:
        """Number of processes (1 alone)."""
        return tdist.get_world_size() if self._group() else 1

    def barrier(self) -> None:
        """Wait for every rank."""
        if self._group():
            tdist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """A reduced copy of ``tensor`` (any device, any float dtype; ``mean`` divides)."""
        if not self._group():
            return tensor.clone() if op == "mean" else tensor
        work = tensor.detach().to(self._comm_device(), copy=True)
        if work.dtype in (torch.float16, torch.bfloat16):
            work = work.float()  # gloo cannot reduce half types; sums need the precision anyway
        tdist.all_reduce(work, op=_TORCH_OPS[op])
        if op == "mean":
            work = work / self.world_size()
        return work.to(tensor.device, dtype=tensor.dtype)

    @staticmethod
    def _comm_device() -> torch.device:
        # NCCL only reduces CUDA tensors; gloo reduces CPU tensors.
        if tdist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def start_reduce(self, value: float, op: str) -> "Reduction":
        """Start reducing a number across ranks without waiting; ``.result()`` waits and gives it.

        Runs on the engine's side group when it has one (see :meth:`start`).

        Example::

            pending = engine.start_reduce(1.0, "max")
            ...                                      # more work; the reduction runs meanwhile
            total = pending.result()
        """
        if not self._group():
            return Reduction(None, torch.tensor([float(value)], dtype=torch.float64))
        side = getattr(self, "_side", None)
        device = torch.device("cpu") if side is not None else self._comm_device()
        return self._start(torch.tensor([float(value)], dtype=torch.float64, device=device), op,
                           side)

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> "Reduction":
        """Start reducing a float64 tensor across ranks on the main group without waiting (on
        the tensor's device: no device sync); ``.tensor_result()`` waits and gives it.

        Example::

            pending = engine.start_all_reduce(torch.tensor([loss_sum, count]))
            ...                                      # backward, optimizer step
            loss_sum, count = pending.tensor_result().tolist()
        """
        if not self._group():
            return Reduction(None, tensor.detach().clone())
        return self._start(tensor.detach().to(self._comm_device(), copy=True), op, None)

    def _start(self, tensor: torch.Tensor, op: str, group: Any) -> "Reduction":
        work = tdist.all_reduce(tensor, op=_TORCH_OPS[op], group=group, async_op=True)
        return Reduction(work, tensor, self.world_size() if op == "mean" else 1)

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's object, in rank order."""
        if not self._group():
            return [obj]
        out: List[Any] = [None] * self.world_size()
        tdist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s object, on every rank."""
        if not self._group():
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=src)
        return box[0]

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
