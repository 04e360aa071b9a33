"""The start-up and collectives over ``torch.distributed`` that the ddp, fsdp, dp and none
engines share (alone, without a group, every collective answers for one process).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as tdist

from ..env.detect import ClusterEnv
from ..env.dist import init_process_group, shutdown
from .base import Engine, Reduction

__all__ = ["TorchEngine"]

_TORCH_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN,
              "mean": tdist.ReduceOp.SUM}


class TorchEngine(Engine):
    """An engine whose processes meet in a ``torch.distributed`` process group: its start-up,
    its shutdown and its collectives; subclasses say how the model is wrapped.

    Example::

        class MyEngine(TorchEngine):
            name = "mine"

            def wrap(self, model, env, device, options):
                return MyWrapper(model.to(device))
    """

    # ------------------------------------------------------------------ start-up
    def start(self, env: ClusterEnv, device: torch.device, backend: Optional[str],
              init_method: Optional[str], timeout: timedelta) -> Optional[str]:
        """Join the other processes; returns the backend name (None for one process).

        Also a small gloo group of the same ranks for the loop's own questions (is a stop
        requested?): CPU numbers, no device sync, and a question still in flight when a peer
        hangs times out there, not in the training's collectives."""
        name = init_process_group(env, device, backend, init_method, timeout)
        if name is not None and self._group():
            self._side = tdist.new_group(backend="gloo", timeout=timeout)
            # gloo connects a group's mesh in its constructor, and a rank can be done with its
            # side first: it went on, failed a config check (one line, exit 2) and left while a
            # peer still connected, which then printed gloo's error and a peer-failure line
            # beside rank 0's one line. No rank leaves set-up before every rank is connected.
            tdist.barrier(group=self._side)
        return name

    def store(self) -> Any:
        """The key-value store the ranks share (the rendezvous store), or None."""
        if not self._group():
            return None
        try:
            return tdist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError):  # a private helper of torch: may move
            return None

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
