"""Measuring on this machine what the step-time model (``ddpkit.stepcost``) needs: a model's
gradient buckets as DDP would make them, the compute time of its forward + backward, each comm
hook's own compute on the gradients' shapes, the matmul rate. ``ddpkit plan`` and
``comm_hook="auto"`` both stand on it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from .stepcost import BUCKET_CAP, FIRST_BUCKET, buckets

__all__ = ["Workload", "workload_of", "measure_compute", "measure_flops", "measure_hook"]


@dataclass(frozen=True)
class Workload:
    """What the model makes the network carry per step. Example::

        workload_of(torchvision.models.resnet18(), compute_s=0.05, batch=32)
    """

    name: str
    bucket_shapes: Tuple[Tuple[Tuple[int, ...], ...], ...]   # in the order they are ready
    params: int
    compute_s: float       # forward + backward of one rank's batch on its device
    batch: int             # samples per rank per step


def workload_of(model: nn.Module, compute_s: float, batch: int, name: str = "model",
                cap: int = BUCKET_CAP, first: int = FIRST_BUCKET) -> Workload:
    """The buckets DDP would make from ``model``'s trainable parameters.

    Example::

        workload_of(nn.Linear(1024, 1024), compute_s=0.01, batch=64)
    """
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    sizes = [4 * math.prod(s) for s in shapes]
    grouped = tuple(tuple(shapes[i] for i in bucket) for bucket in buckets(sizes, cap, first))
    return Workload(name, grouped, sum(math.prod(s) for s in shapes), compute_s, batch)


def measure_compute(model: nn.Module, example: torch.Tensor, repeats: int = 3) -> float:
    """Median seconds of forward + backward of ``example`` through ``model`` (after a warm-up).

    Example::

        measure_compute(nn.Linear(64, 10), torch.randn(32, 64))
    """
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        out = model(example)
        (out if torch.is_tensor(out) else out[0]).float().sum().backward()
        if example.is_cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def measure_flops(device: Optional[torch.device] = None, n: int = 512) -> float:
    """This device's matmul rate (flop/s), for PowerSGD's extra compute.

    Example::

        measure_flops()   # e.g. 5e10 on 2 CPU cores
    """
    a = torch.randn(n, n, device=device)
    a @ a
    count, start = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - start < 0.05:  # long enough to time
        a @ a
        count += 1
        if a.is_cuda:
            torch.cuda.synchronize()
    return count * 2 * n ** 3 / (time.perf_counter() - start)


def measure_hook(work: Workload, hook: str, rank: int = 2,
                 device: Optional[torch.device] = None, repeats: int = 3) -> float:
    """Seconds per step of ``hook``'s own work on this device: torch's own hook (as the DDP
    engine registers it) run on buckets of the model's gradient shapes over a process group of
    this process alone, so its all-reduces cost nothing and what is left is its compute (the
    casts of fp16/bf16; PowerSGD's error feedback, P = MQ, orthogonalisation, Q = M^T P, the
    reconstruction and its per-tensor Python work). Inside a job (a process group already
    there) the same work is timed as plain tensor math instead.

    Example::

        measure_hook(workload, "powersgd", rank=2)
    """
    if hook == "none":
        return 0.0
    import torch.distributed as dist

    device = device or torch.device("cpu")
    if dist.is_available() and not dist.is_initialized():
        return _real_hook_seconds(work, hook, rank, device, repeats)
    shapes = [s for bucket in work.bucket_shapes for s in bucket]
    if hook in ("fp16", "bf16"):
        half = torch.float16 if hook == "fp16" else torch.bfloat16
        grads = [torch.randn(s, device=device) for s in shapes]
        work_fn = lambda: [g.to(half).to(torch.float32) for g in grads]  # noqa: E731
    else:
        mats = [(torch.randn(s[0], math.prod(s) // s[0], device=device),
                 torch.zeros(s[0], math.prod(s) // s[0], device=device),
                 torch.randn(math.prod(s) // s[0], min(rank, s[0]), device=device))
                for s in shapes if len(s) > 1]
        work_fn = lambda: [_powersgd_math(*m) for m in mats]  # noqa: E731
    work_fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work_fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _real_hook_seconds(work: Workload, hook: str, rank: int, device: torch.device,
                       repeats: int) -> float:
    """``hook`` timed by ``ddpkit.autohook.time_hooks`` over a process group of one, made here
    and taken down after."""
    import tempfile

    import torch.distributed as dist

    from .autohook import time_hooks          # both stand on this module: imported late
    from .engines.ddp import comm_hook_for
    from .wrap import WrapOptions

    with tempfile.TemporaryDirectory(prefix="ddpkit-hook-") as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            return time_hooks(work.bucket_shapes, [(hook, rank)], lambda name, r, group=None:
                              comm_hook_for(name, WrapOptions(powersgd_rank=r), group),
                              device, group=dist.group.WORLD, steps=repeats)[(hook, rank)]
        finally:
            dist.destroy_process_group()


def _powersgd_math(grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor) -> None:
    grad.add_(error)
    p, _ = torch.linalg.qr(grad @ q)
    q = grad.t() @ p
    error.copy_(grad - p @ q.t())
