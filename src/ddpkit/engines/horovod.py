"""The ``horovod`` engine: Horovod's collectives and ``DistributedOptimizer`` instead of torch DDP.

Horovod is optional and never a dependency (build it with ``scripts/build_horovod.sh``). When a
process was started by ``horovodrun`` (or ``ddpkit train --engine horovod``),
:func:`ddpkit.setup` picks this engine: ``hvd.init()`` replaces ``init_process_group``, and
ddpkit's rank utilities (:mod:`ddpkit.engines.comm`: reduce, gather, broadcast, barrier) run on
Horovod's collectives, so exact evaluation, checkpoint agreement and logging work unchanged.
Gradients are averaged by ``hvd.DistributedOptimizer`` (:meth:`HorovodEngine.optimizer`),
optionally fp16-compressed, with parameters and optimizer state broadcast from rank 0;
``hvd.join()`` at the end lets a rank that ran out of batches serve the others' all-reduces.

Example::

    horovodrun -np 2 --gloo python train.py       # train.py: rt = ddpkit.setup()  (auto-detected)
    ddpkit train --engine horovod --nproc 2     # the same for the built-in job
"""
from __future__ import annotations

import contextlib
import sys
from datetime import timedelta
from typing import Any, ContextManager, List, Mapping, Optional, Sequence

import torch
from torch import nn

from ..env.detect import ClusterEnv
from ..base.errors import ConfigError
from ..base.wrap import WrapOptions
from .base import Engine, Reduction

__all__ = ["HorovodEngine", "missing_reason", "started_by_horovod", "COMPRESSIONS"]

COMPRESSIONS = ("fp16",)  # comm_hook values Horovod can do (Compression.fp16)


def missing_reason() -> Optional[str]:
    """``None`` when ``horovod.torch`` imports, else why not (one line, with the fix).

    Example::

        if missing_reason(): print("horovod rows skipped:", missing_reason())
    """
    try:
        import horovod.torch  # noqa: F401
    except ImportError as exc:
        return (f"horovod is not installed ({exc}); build it with scripts/build_horovod.sh "
                "or `make horovod`")
    except Exception as exc:  # a broken build raises at import (missing symbol, wrong torch)
        return f"horovod.torch does not import ({type(exc).__name__}: {exc}); rebuild it"
    return None


def started_by_horovod(environ: Mapping[str, str]) -> bool:
    """True in a process launched by ``horovodrun`` (gloo or MPI).

    Example::

        started_by_horovod(os.environ)
    """
    return "HOROVOD_RANK" in environ and "HOROVOD_SIZE" in environ


def _hvd() -> Any:
    """``horovod.torch`` once ``hvd.init()`` ran in this process, else None (Horovod's own state:
    nothing of ours to keep in sync)."""
    hvd = sys.modules.get("horovod.torch")
    return hvd if hvd is not None and hvd.is_initialized() else None


class HorovodEngine(Engine):
    """Horovod's collectives; the model is broadcast, not wrapped; its optimizer averages.

    Example::

        rt = ddpkit.setup(engine="horovod")        # under horovodrun: automatic
        model = rt.wrap(Net())
        opt = rt.optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    """

    name = "horovod"
    launcher = "horovodrun"  # what starts this engine's processes for `ddpkit train`

    @classmethod
    def running(cls) -> bool:
        hvd = _hvd()
        return hvd is not None and hvd.size() > 1

    @staticmethod
    def _module() -> Any:
        hvd = _hvd()
        if hvd is None:
            raise RuntimeError("the Horovod engine is not initialised; call ddpkit.setup() first")
        return hvd

    def serves(self, engine: str) -> bool:
        # A DDP script runs unchanged under horovodrun: its rt.wrap(model) asks for "ddp".
        return engine in ("horovod", "ddp")

    def unavailable(self) -> Optional[str]:
        return missing_reason()

    def environment(self, env: Optional[ClusterEnv], argv: Sequence[str],
                    expected_world_size: Optional[int]) -> ClusterEnv:
        """``hvd.init()``: Horovod says where this process stands."""
        reason = missing_reason()
        if reason:
            raise ConfigError(reason)
        import horovod.torch as hvd

        hvd.init()
        return ClusterEnv(rank=hvd.rank(), world_size=hvd.size(), local_rank=hvd.local_rank(),
                          local_world_size=hvd.local_size(), node_rank=hvd.cross_rank(),
                          launcher="horovod")

    def start(self, env: ClusterEnv, device: torch.device, backend: Optional[str],
              init_method: Optional[str], timeout: timedelta) -> Optional[str]:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return "horovod"  # hvd.init() took the place of the process group

    def store(self) -> Any:
        return None  # Horovod has no store the ranks share; hangs are reported without it

    def check_options(self, options: WrapOptions) -> None:
        """Reject DDP-only options under Horovod with one line each.

        Example::

            HorovodEngine().check_options(WrapOptions(comm_hook="powersgd"))   # ConfigError
        """
        if options.comm_hook is not None and options.comm_hook not in COMPRESSIONS:
            raise ConfigError(f"comm hook {options.comm_hook!r} is DDP-only; with engine "
                              "'horovod' use --comm-hook fp16 (Horovod's fp16 compression) or none")
        if options.sync_bn:
            raise ConfigError("--sync-bn is not supported with engine 'horovod' in ddpkit; "
                              "use ddp")

    def wrap(self, model: nn.Module, env: ClusterEnv, device: torch.device,
             options: WrapOptions) -> nn.Module:
        """Rank 0's parameters and buffers to every rank (Horovod needs no model wrapper)."""
        self.check_options(options)
        model = model.to(device)
        hvd = _hvd()
        if hvd is None:
            if env.is_distributed:
                raise ConfigError("engine 'horovod' needs Horovod's processes: start the "
                                  "script with horovodrun (or `ddpkit train --engine horovod`)")
            return model
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if hvd.size() > 1 and not hasattr(model, "_ddpkit_hvd_guard"):
            model._ddpkit_hvd_guard = model.register_forward_pre_hook(_require_optimizer)
        return model

    def optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, accum_steps: int = 1,
                  compression: Optional[str] = None) -> torch.optim.Optimizer:
        """Wrap in ``hvd.DistributedOptimizer`` and broadcast rank 0's optimizer state.

        ``accum_steps`` becomes ``backward_passes_per_step``: one all-reduce per optimizer step.
        Idempotent: an optimizer wrapped before is returned as it is.
        """
        hvd = _hvd()
        if hvd is None or getattr(optimizer, "_ddpkit_horovod", False):
            return optimizer
        from ..base.wrap import unwrap

        comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        names = {p: n for n, p in unwrap(model).named_parameters()}
        named = [(names[p], p) for g in optimizer.param_groups for p in g["params"] if p in names]
        wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=named or None,
                                           compression=comp, backward_passes_per_step=accum_steps)
        # Horovod's copy shares the param_group dicts (an LR scheduler of the original still
        # drives it) but not the state: carry over anything the original already holds.
        wrapped.load_state_dict(optimizer.state_dict())
        # A fresh optimizer has no state on any rank: nothing to send. (Horovod would otherwise
        # initialise it with a zero-gradient step, which moves weights under weight decay.)
        if hvd.broadcast_object(len(optimizer.state) > 0, root_rank=0):
            hvd.broadcast_optimizer_state(wrapped, root_rank=0)
        wrapped._ddpkit_horovod = True
        unwrap(model)._ddpkit_hvd_optimizer = True
        return wrapped

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        # backward_passes_per_step already all-reduces once per optimizer step
        return contextlib.nullcontext()

    def synchronized(self, optimizer: torch.optim.Optimizer) -> ContextManager[Any]:
        # DistributedOptimizer averages inside step(); clipping, the finite check and
        # GradScaler's unscale must see averaged gradients, so average first, then step without.
        if hasattr(optimizer, "skip_synchronize"):
            optimizer.synchronize()
            return optimizer.skip_synchronize()
        return contextlib.nullcontext()

    def shutdown(self) -> None:
        """Let ranks with fewer batches finish (``hvd.join``), then shut Horovod down."""
        hvd = _hvd()
        if hvd is not None:
            if hvd.size() > 1:
                hvd.join()
            hvd.shutdown()

    # ------------------------------------------------------------------ collectives
    def rank(self) -> int:
        return self._module().rank()

    def world_size(self) -> int:
        return self._module().size()

    def barrier(self) -> None:
        self._module().barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        hvd = self._module()
        work = tensor.detach().to("cpu", copy=True)
        if work.dtype in (torch.float16, torch.bfloat16):
            work = work.float()
        hop = {"sum": hvd.Sum, "mean": hvd.Sum, "max": hvd.Max, "min": hvd.Min}[op]
        work = hvd.allreduce(work, op=hop, name=None)
        if op == "mean":
            work = work / hvd.size()
        return work.to(tensor.device, dtype=tensor.dtype)

    def start_reduce(self, value: float, op: str) -> Reduction:
        # Horovod's allreduce_async would need its own handle type: reduce now.
        return Reduction(None, self.all_reduce(torch.tensor([float(value)], dtype=torch.float64),
                                               op))

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Reduction:
        return Reduction(None, self.all_reduce(tensor, op))

    def all_gather_object(self, obj: Any) -> List[Any]:
        return list(self._module().allgather_object(obj))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        # Horovod names the collective after type(obj) unless told: None on the receiving
        # ranks and a list on the root would be two collectives, each waiting for the other.
        return self._module().broadcast_object(obj, root_rank=src,
                                               name="ddpkit.broadcast_object")


def _require_optimizer(module: nn.Module, args: Any) -> None:
    # Without Horovod's DistributedOptimizer nothing averages the gradients and every rank
    # would silently train its own model: refuse the first training step instead.
    if module.training and not getattr(module, "_ddpkit_hvd_optimizer", False):
        raise ConfigError("under Horovod, pass the optimizer through rt.optimizer(optimizer, "
                          "model) before training (it averages the gradients across ranks)")
