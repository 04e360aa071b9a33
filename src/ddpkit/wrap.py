"""What wrapping takes and gives back: :class:`WrapOptions` (the knobs of the engines' ``wrap``)
and :func:`unwrap`, the user's own module inside any wrapper (what to save and load).

The wrapping itself is each engine's job: :mod:`ddpkit.engines`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

__all__ = ["WrapOptions", "unwrap"]


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
    """The user's module inside DDP / DataParallel / ``torch.compile`` wrappers, however nested.

    Horovod wraps nothing (its optimizer averages the gradients), so its model is itself.
    Checkpoints save ``unwrap(model).state_dict()``: keys without ``module.`` or
    ``_orig_mod.``, loadable into the plain model.

    Example::

        torch.save(unwrap(model).state_dict(), "model.pt")
    """
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model
