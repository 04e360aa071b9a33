"""The ``fsdp`` engine: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``). Every rank holds
1/N of the parameters, gradients and optimizer state; a block's parameters are gathered for its
forward and backward and its gradients reduce-scattered. Checkpoints are sharded
(:mod:`ddpkit.checkpoint.sharded`, ``torch.distributed.checkpoint``) and resume on any number of ranks.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

from ..env.detect import ClusterEnv
from ..env.dist import resolve_backend
from ..base.errors import ConfigError
from ..base.wrap import WrapOptions
from .torchdist import TorchEngine

__all__ = ["FSDPEngine", "shard_units"]

Units = Union[Sequence[type], Callable[[nn.Module], bool], None]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def shard_units(model: nn.Module, units: Units = None) -> List[nn.Module]:
    """The submodules that become FSDP units (each gathered and freed on its own).

    ``units``: module classes, or a predicate on modules; by default the model's repeated
    blocks: the members of every ``ModuleList`` / ``Sequential`` holding at least two children of
    one class that have parameters (transformer blocks, ResNet blocks). Units never nest.

    Example::

        shard_units(gpt)                         # its 4 transformer blocks
        shard_units(model, units=[MyBlock])      # a user policy
    """
    if units is None:
        chosen: List[nn.Module] = []
        for parent in model.modules():
            if isinstance(parent, (nn.ModuleList, nn.Sequential)):
                kids = [c for c in parent.children() if _has_params(c)]
                kinds = {type(c) for c in kids}
                if len(kids) >= 2 and len(kinds) == 1:
                    chosen.extend(kids)
    else:
        pick = units if callable(units) and not isinstance(units, (list, tuple)) else \
            (lambda m: isinstance(m, tuple(units)))  # type: ignore[arg-type]
        chosen = [m for m in model.modules() if m is not model and pick(m)]
    out: List[nn.Module] = []
    inside: set = set()
    for module in chosen:  # outermost first (modules() is pre-order): skip nested ones
        if id(module) in inside:
            continue
        out.append(module)
        inside.update(id(m) for m in module.modules())
    return out


class FSDPEngine(TorchEngine):
    """Fully sharded data parallel (FSDP2): parameters, gradients and optimizer state split
    across ranks. With one process the model is only moved to its device.

    Example::

        rt = ddpkit.setup(engine="fsdp")
        model = rt.wrap(GPT(), mixed_precision="bf16")       # fully_shard on blocks + root
    """

    name = "fsdp"

    def unavailable(self) -> Optional[str]:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return (f"FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6; this is "
                    f"{torch.__version__}: pip install -U torch, or use --engine ddp")
        return None

    def start(self, env: ClusterEnv, device: torch.device, backend: Optional[str],
              init_method: Optional[str], timeout: timedelta) -> Optional[str]:
        # Seen on an H100 (torch 2.11): fully_shard over gloo with CUDA tensors dies by SIGSEGV
        # in its first collective (pytorch/pytorch#132471). One line before the group instead.
        if env.is_distributed and device.type == "cuda" and \
                resolve_backend(backend, device) == "gloo":
            raise ConfigError("FSDP on GPUs needs NCCL: gloo cannot run its collectives on CUDA "
                              "tensors (the ranks crash); use one process per GPU without "
                              "--backend gloo, or --accelerator cpu to try FSDP on one machine")
        return super().start(env, device, backend, init_method, timeout)

    def check_options(self, options: WrapOptions) -> None:
        if options.sync_bn:
            raise ConfigError("--sync-bn is not supported with --engine fsdp; use "
                              "--engine ddp for SyncBatchNorm")
        if options.comm_hook:
            raise ConfigError("--comm-hook is a DDP gradient hook; FSDP reduces gradients in "
                              "its own precision (--precision bf16 reduces in fp32)")

    def wrap(self, model: nn.Module, env: ClusterEnv, device: torch.device,
             options: WrapOptions) -> nn.Module:
        self.check_options(options)
        reason = self.unavailable()
        if reason:
            raise ConfigError(f"--engine fsdp: {reason}")
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                raise ConfigError(f"FSDP shards floating-point parameters only; parameter "
                                  f"{name!r} is {p.dtype}: make it a buffer, or use --engine "
                                  "ddp")
        model = model.to(device)
        if not env.is_distributed:
            return model
        import torch.distributed as tdist
        if not tdist.is_initialized():  # Horovod's ranks, or a DataParallel-only process
            raise ConfigError("--engine fsdp needs torch.distributed's process group: start "
                              "with ddpkit run / torchrun (not horovodrun) and "
                              "ddpkit.setup(engine='fsdp')")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw: dict = {"reshard_after_forward": options.reshard_after_forward}
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.mixed_precision or "")
        if dtype is not None:  # compute in low precision, reduce gradients in fp32
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for unit in shard_units(model, options.fsdp_units):
            fully_shard(unit, **kw)
        fully_shard(model, **kw)
        return model

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        setter = getattr(model, "set_requires_gradient_sync", None)
        if not callable(setter):
            return super().no_sync(model)
        return _no_gradient_sync(model)


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    # Accumulate unsharded gradients locally; the final micro-step reduce-scatters them.
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
