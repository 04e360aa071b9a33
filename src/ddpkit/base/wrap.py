"""What wrapping takes and gives back: :class:`WrapOptions` (the knobs of the engines' ``wrap``)
and :func:`unwrap`, the user's own module inside any wrapper (what to save and load).

The wrapping itself is each engine's job: :mod:`ddpkit.engines`.
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from .errors import ConfigError

__all__ = ["WrapOptions", "unwrap", "check_not_wrapped", "compile_model", "compile_unavailable",
           "check_compile"]


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
    comm_hook: Optional[str] = None  # fp16 | bf16 | powersgd | powersgd-batched | auto
    powersgd_rank: Optional[int] = None  # PowerSGD's rank (None: 2, batched 4; cost.model)
    powersgd_start_iter: int = 10    # plain all-reduce for the first N steps (PowerSGD warm-up)
    compile: bool = False            # torch.compile the wrapped model (see compile_model)
    # fsdp: which submodules are sharded units (classes or a predicate; default: repeated
    # blocks), compute precision (bf16 | fp16, gradients reduced in fp32), free after forward
    fsdp_units: Any = None
    mixed_precision: Optional[str] = None
    reshard_after_forward: bool = True
    compile_mode: Optional[str] = None  # torch.compile mode: max-autotune, reduce-overhead, ...


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / ``torch.compile`` wrappers, however nested.

    Horovod wraps nothing (its optimizer averages the gradients), so its model is itself.
    Checkpoints save ``unwrap(model).state_dict()``: keys without ``module.`` or
    ``_orig_mod.``, loadable into the plain model.

    Example::

        torch.save(unwrap(model).state_dict(), "model.pt")
    """
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)) or \
                getattr(type(model), "wraps_module", False):  # ddpkit's own wrappers
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def check_not_wrapped(model: nn.Module, wrapped_as: Optional[str] = None) -> None:
    """One line for a model that is already wrapped, by ``rt.wrap`` (``wrapped_as`` names the
    wrapper it got) or by hand: a second DDP around the same parameters breaks at the first
    backward with an error about bucket views that names neither call.

    Example::

        check_not_wrapped(DistributedDataParallel(net))   # ConfigError: already wrapped
    """
    inner = type(unwrap(model)).__name__
    if wrapped_as is not None:
        raise ConfigError(f"rt.wrap was already called on this {inner} (it returned a "
                          f"{wrapped_as}): wrap a model once and keep using what rt.wrap "
                          "returned; for a second copy (a teacher, an EMA) wrap "
                          "copy.deepcopy(rt.unwrap(model))")
    if unwrap(model) is not model:
        raise ConfigError(f"rt.wrap got a model that is already wrapped ({type(model).__name__} "
                          f"around {inner}): wrap your plain module once, and use what rt.wrap "
                          "returns (rt.unwrap(model) gives the plain module back, to save or "
                          "evaluate)")
    inside = next((m for m in model.modules()
                   if isinstance(m, (DistributedDataParallel, DataParallel))), None)
    if inside is not None:  # another library's wrapper around one (Fabric's _FabricModule)
        raise ConfigError(f"rt.wrap got a {type(model).__name__} with a {type(inside).__name__} "
                          "inside: another library wrapped it already (fabric.setup, "
                          "accelerator.prepare); pass rt.wrap the plain module, and train "
                          "either with ddpkit's wrapper or with the other library's, not both")


def compile_unavailable(device: torch.device) -> Optional[str]:
    """Why ``torch.compile`` (its default inductor backend) cannot run here, or None.

    Checked before training so that a missing piece is one line instead of a compiler traceback
    at the first step.

    Example::

        compile_unavailable(torch.device("cpu"))   # None where a C++ compiler is installed
    """
    try:
        import torch._dynamo as dynamo
        supported = dynamo.is_dynamo_supported()
    except Exception:  # an import failure is the answer too
        supported = False
    if not supported:
        return (f"torch.compile does not support Python {sys.version_info.major}."
                f"{sys.version_info.minor} with torch {torch.__version__}")
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - very old torch
            return None
        if not has_triton():
            return "torch.compile on GPUs needs triton (pip install triton)"
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "torch.compile on CPU needs a C++ compiler (g++ or clang++) on PATH"
    return None


def check_compile(device: torch.device) -> None:
    """Raise one clear :class:`ConfigError` if ``torch.compile`` cannot run on ``device`` here.

    Example::

        check_compile(torch.device("cpu"))   # ConfigError without a C++ compiler
    """
    reason = compile_unavailable(device)
    if reason:
        raise ConfigError(f"--compile: {reason}; drop --compile to train without it")


def compile_model(model: nn.Module, device: torch.device, mode: Optional[str] = None) -> nn.Module:
    """``torch.compile(model)``, after checking that it can run here (one clear error if not).

    Compile the wrapped model (DDP's optimizer splits the graph at its buckets); checkpoints
    stay clean because :func:`unwrap` removes the ``_orig_mod.`` layer.

    Example::

        model = compile_model(rt.wrap(Net()), rt.device)
    """
    check_compile(device)
    return torch.compile(model, mode=mode)
