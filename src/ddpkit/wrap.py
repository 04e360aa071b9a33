"""Model wrapping strategies: ``ddp`` (DistributedDataParallel), ``dp`` (DataParallel),
``horovod`` (Horovod engine: broadcast only, gradients averaged by its optimizer), ``none``.

Also SyncBatchNorm conversion and :func:`unwrap` to get the plain module back for saving.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from .env import ClusterEnv
from .errors import ConfigError

__all__ = ["STRATEGIES", "WrapOptions", "wrap_model", "unwrap", "bf16_compress_any_backend"]

STRATEGIES = ("ddp", "dp", "horovod", "none")


@dataclass
class WrapOptions:
    """DDP knobs. ``gradient_as_bucket_view`` saves a gradient-sized copy and is on by default.

    Example::

        WrapOptions(find_unused_parameters=True, bucket_cap_mb=50)
    """

    sync_bn: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool = True
    comm_hook: Optional[str] = None  # fp16 | bf16 | powersgd
    powersgd_rank: int = 2           # matrix approximation rank of PowerSGD
    powersgd_start_iter: int = 10    # plain all-reduce for the first N steps (PowerSGD warm-up)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel wrappers (what to save and load).

    Example::

        torch.save(unwrap(model).state_dict(), "model.pt")
    """
    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def _wrap_dp(model: nn.Module, device: torch.device) -> nn.Module:
    if device.type != "cuda" or torch.cuda.device_count() < 1:
        warnings.warn("strategy 'dp' needs CUDA devices; on CPU the plain module is used")
        return model
    return DataParallel(model)


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


def _register_comm_hook(model: DistributedDataParallel, name: str,
                        opts: Optional[WrapOptions] = None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    opts = opts or WrapOptions()
    hooks: dict[str, Callable[[], tuple]] = {
        "fp16": lambda: (None, default.fp16_compress_hook),
        "bf16": lambda: (None, default.bf16_compress_hook),
        "powersgd": lambda: (powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=opts.powersgd_rank,
            start_powerSGD_iter=opts.powersgd_start_iter), powersgd.powerSGD_hook),
    }
    if name not in hooks:
        raise ConfigError(f"unknown comm hook {name!r}; choose one of {', '.join(hooks)}")
    if name == "bf16" and torch.distributed.get_backend() != "nccl":
        # torch's bf16_compress_hook insists on NCCL >= 2.10 (it raises on gloo at the first step)
        hooks["bf16"] = lambda: (None, bf16_compress_any_backend)
    state, hook = hooks[name]()
    model.register_comm_hook(state, hook)


def wrap_model(model: nn.Module, env: ClusterEnv, device: torch.device, strategy: str = "ddp",
               options: Optional[WrapOptions] = None) -> nn.Module:
    """Move ``model`` to ``device`` and wrap it for ``strategy``; with one process ``ddp`` is a no-op.

    Example::

        model = wrap_model(Net(), env, device, "ddp", WrapOptions(sync_bn=True))
    """
    _check_strategy(strategy)
    opts = options or WrapOptions()
    if opts.sync_bn and env.is_distributed and strategy == "ddp":
        if device.type == "cpu":
            raise ConfigError("SyncBatchNorm needs GPUs: PyTorch's SyncBatchNorm and DDP refuse "
                              "CPU modules; drop --sync-bn when training on CPU")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if strategy == "horovod":
        from . import horovod_engine
        horovod_engine.check_options({"comm_hook": opts.comm_hook, "sync_bn": opts.sync_bn})
        if horovod_engine.is_active():
            return horovod_engine.broadcast_model(model)
        if env.is_distributed:
            raise ConfigError("strategy 'horovod' needs the Horovod engine: start the script "
                              "with horovodrun (or `ddpkit train --strategy horovod`)")
        return model
    if strategy == "dp":
        return _wrap_dp(model, device)
    if strategy == "none" or not env.is_distributed:
        return model
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=opts.find_unused_parameters, static_graph=opts.static_graph,
        bucket_cap_mb=opts.bucket_cap_mb, gradient_as_bucket_view=opts.gradient_as_bucket_view,
        # Only pass the non-default: newer torch warns that this argument is deprecated.
        **({} if opts.broadcast_buffers else {"broadcast_buffers": False}))
    if opts.comm_hook:
        _register_comm_hook(ddp, opts.comm_hook, opts)
    return ddp
