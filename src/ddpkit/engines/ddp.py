"""The ``ddp`` engine: ``DistributedDataParallel`` over the process group, with SyncBatchNorm,
gradient compression hooks (fp16, bf16 on any backend, PowerSGD, or chosen from measurements:
``auto``) and the DDP knobs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..cost import auto as autohook
from ..env.detect import ClusterEnv
from ..base.errors import ConfigError
from ..cost.lowrank import BatchedPowerSGD, batched_powersgd_hook
from ..cost.model import DEFAULT_RANKS
from ..base.wrap import WrapOptions
from .buckets import install_steady_buckets
from .torchdist import TorchEngine

__all__ = ["DDPEngine", "bf16_compress_any_backend", "register_comm_hook", "comm_hook_for",
           "COMM_HOOKS"]

#: "auto" measures the step and the link at the first training step and picks one of the others
#: (ddpkit.cost.auto).
COMM_HOOKS = ("fp16", "bf16", "powersgd", "powersgd-batched", "auto")


class DDPEngine(TorchEngine):
    """Each process holds a replica; DDP all-reduces gradient buckets during backward.

    With one process the model is only moved to its device (nothing to synchronise).

    Example::

        model = DDPEngine().wrap(Net(), env, device, WrapOptions(sync_bn=True))
    """

    name = "ddp"

    def wrap(self, model: nn.Module, env: ClusterEnv, device: torch.device,
             options: WrapOptions) -> nn.Module:
        if options.sync_bn and device.type == "cpu":  # on 1 process as on N: the same answer
            raise ConfigError("SyncBatchNorm needs GPUs: PyTorch's SyncBatchNorm and DDP refuse "
                              "CPU modules; leave out sync_bn=True (rt.wrap) / --sync-bn "
                              "(ddpkit train) when training on CPU")
        if options.sync_bn and env.is_distributed:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(device)
        if not env.is_distributed:
            return model
        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=options.find_unused_parameters,
            static_graph=options.static_graph, bucket_cap_mb=options.bucket_cap_mb,
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            # Only pass the non-default: newer torch warns that this argument is deprecated.
            **({} if options.broadcast_buffers else {"broadcast_buffers": False}))
        if options.comm_hook == "auto":
            autohook.install(ddp, lambda hook, rank, group=None: comm_hook_for(
                hook, replace(options, powersgd_rank=rank, powersgd_start_iter=2), group),
                options.bucket_cap_mb)
        elif options.comm_hook:
            register_comm_hook(ddp, options.comm_hook, options)
        install_steady_buckets(ddp)  # after "auto"'s: it runs first and may choose no hook
        return ddp


def bf16_compress_any_backend(group, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: all-reduce each gradient bucket in bfloat16, on any backend (gloo too).

    torch's ``bf16_compress_hook`` does the same but refuses anything but NCCL >= 2.10. Not
    annotated on purpose: DDP checks annotations against its own GradBucket/Future classes.

    Example::

        ddp_model.register_comm_hook(None, bf16_compress_any_backend)
    """
    group = group or torch.distributed.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    fut = torch.distributed.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):  # type: ignore[no-untyped-def]
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


def register_comm_hook(model: DistributedDataParallel, name: str,
                       options: Optional[WrapOptions] = None) -> None:
    """Compress ``model``'s gradient all-reduce: ``fp16``, ``bf16``, ``powersgd`` or
    ``powersgd-batched`` (:mod:`ddpkit.cost.lowrank`).

    Example::

        register_comm_hook(ddp_model, "powersgd", WrapOptions(powersgd_rank=1))
    """
    state, hook = comm_hook_for(name, options)
    model.register_comm_hook(state, hook)


def comm_hook_for(name: str, options: Optional[WrapOptions] = None,
                  group: Optional[Any] = None) -> Tuple[Any, Callable]:
    """``(state, hook)`` of comm hook ``name`` over ``group`` (default: every rank), as DDP's
    ``register_comm_hook`` takes them; ``comm_hook="auto"`` also times them on a group of one.

    Example::

        state, hook = comm_hook_for("bf16")
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    options = options or WrapOptions()
    rank = options.powersgd_rank or DEFAULT_RANKS.get(name, 2)
    hooks: Dict[str, Callable[[], tuple]] = {
        "fp16": lambda: (group, default.fp16_compress_hook),
        "bf16": lambda: (group, default.bf16_compress_hook),
        "powersgd": lambda: (powersgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=rank,
            start_powerSGD_iter=options.powersgd_start_iter), powersgd.powerSGD_hook),
        "powersgd-batched": lambda: (BatchedPowerSGD(
            group, rank, options.powersgd_start_iter), batched_powersgd_hook),
    }
    if name not in hooks:
        raise ConfigError(f"unknown comm hook {name!r}; choose one of {', '.join(COMM_HOOKS)}")
    if name == "bf16" and torch.distributed.get_backend(group) != "nccl":
        # torch's bf16_compress_hook insists on NCCL >= 2.10 (it raises on gloo at the first step)
        hooks["bf16"] = lambda: (group, bf16_compress_any_backend)
    return hooks[name]()
