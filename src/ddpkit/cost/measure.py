"""Measuring on this machine what the step-time model (``ddpkit.cost.model``) needs: a model's
gradient buckets as DDP would make them, the compute time of its forward + backward, an
all-reduce's time, the link's latency and bandwidth, a comm hook's own cost, the matmul rate.
``ddpkit plan`` (whose ``.calibrate`` times the job and each comm hook on the job's ranks) and
``comm_hook="auto"`` both stand on it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from .model import BUCKET_CAP, FIRST_BUCKET, Link, buckets, fit_link

__all__ = ["Workload", "workload_of", "Timing", "repeat_timing", "measure_compute",
           "measure_flops", "time_allreduce", "sync_device", "probe_link", "time_hooks"]


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
    buffer_bytes: int = 0  # what DDP broadcasts from rank 0 before every training forward


def workload_of(model: nn.Module, compute_s: float, batch: int, name: str = "model",
                cap: int = BUCKET_CAP, first: int = FIRST_BUCKET) -> Workload:
    """The buckets DDP would make from ``model``'s trainable parameters, and the bytes of its
    buffers (BatchNorm's statistics), which DDP broadcasts at every training forward.

    Example::

        workload_of(nn.Linear(1024, 1024), compute_s=0.01, batch=64)
    """
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    sizes = [4 * math.prod(s) for s in shapes]
    grouped = tuple(tuple(shapes[i] for i in bucket) for bucket in buckets(sizes, cap, first))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return Workload(name, grouped, sum(math.prod(s) for s in shapes), compute_s, batch,
                    buffers)


@dataclass(frozen=True)
class Timing:
    """Seconds of one thing timed several times: the median, and the spread (min-max) that says
    how far one timing could have been from it. Example::

        Timing.of([0.012, 0.010, 0.031]).median   # 0.012
    """

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Timing":
        ordered = sorted(samples)
        if not ordered:
            raise ValueError("a timing needs at least one sample")
        half = len(ordered) // 2
        middle = ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2
        return cls(middle, ordered[0], ordered[-1], len(ordered))

    def __str__(self) -> str:
        return (f"{_ms(self.median)} ms (median of {self.count}, min-max {_ms(self.low)}-"
                f"{_ms(self.high)} ms)")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def repeat_timing(fn: Callable[[], Any], repeats: int = 7, warmup: int = 2,
                  device: Optional[torch.device] = None) -> Timing:
    """``fn()`` run ``warmup`` times untimed (allocations, oneDNN primitives, caches: the first
    calls are not what a training step costs), then timed ``repeats`` times.

    Example::

        repeat_timing(lambda: torch.randn(512, 512) @ torch.randn(512, 512))
    """
    device = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    sync_device(device)
    samples = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        fn()
        sync_device(device)
        samples.append(time.perf_counter() - start)
    return Timing.of(samples)


def measure_compute(model: nn.Module, example: torch.Tensor, repeats: int = 7) -> float:
    """Median seconds of forward + backward of ``example`` through ``model`` (after a warm-up).

    Example::

        measure_compute(nn.Linear(64, 10), torch.randn(32, 64))
    """
    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(example)
        (out if torch.is_tensor(out) else out[0]).float().sum().backward()

    return repeat_timing(step, repeats, 2, example.device).median


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


def time_allreduce(tensor: torch.Tensor, group: Any = None) -> float:
    """Seconds of one all-reduce of ``tensor`` over ``group``, the slowest rank's (agreed by a
    second, tiny all-reduce: every rank gets the same number). Collective.

    Example::

        time_allreduce(torch.ones(1 << 20))   # e.g. 0.0021 on 2 ranks over loopback
    """
    import torch.distributed as dist

    sync_device(tensor.device)
    start = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    sync_device(tensor.device)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
    return float(took.item())


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU. Example::

        sync_device(torch.device("cpu"))
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_link(device: torch.device, group: Any = None, budget_s: float = 0.1,
               smallest: int = 4 << 10, largest: int = 16 << 20) -> Link:
    """Alpha and beta of the link the ranks of ``group`` all-reduce over, from all-reduces of
    ``smallest`` bytes growing 4x until one takes ``budget_s`` or reaches ``largest``; each
    size timed twice (the slowest rank's time of each, the faster kept). Collective.

    Example::

        link = probe_link(torch.device("cpu"))   # Link('probed', alpha=..., beta=...)
    """
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    buf = torch.zeros(largest // 4, device=device)
    dist.all_reduce(buf[:smallest // 4], group=group)  # connections made before timing
    sizes, seconds, nbytes = [], [], smallest
    while True:
        sizes.append(float(nbytes))
        seconds.append(min(time_allreduce(buf[:nbytes // 4], group) for _ in range(2)))
        if len(sizes) >= 2 and (seconds[-1] >= budget_s or nbytes * 4 > largest):
            return fit_link(sizes, seconds, ranks, "probed")
        nbytes *= 4


def time_hooks(bucket_shapes: Sequence[Sequence[Tuple[int, ...]]], hooks: Sequence[Tuple[str, int]],
               make: Callable[..., Tuple[Any, Callable]], device: torch.device,
               group: Any = None, steps: int = 2, median: bool = False,
               after_step: Optional[Callable[[], Any]] = None) -> Dict[Tuple[str, int], float]:
    """Seconds one step of each ``(hook, powersgd_rank)`` takes: the hook itself (``make(hook,
    rank, group)``, compressing from its first step) run on buckets of ``bucket_shapes`` filled
    with random gradients, one bucket after another, over ``group`` (a group of one rank: its
    compute alone). The fastest of ``steps`` (its own cost), or their ``median`` (what it costs
    while other processes share the cores; ``after_step``, timed with each step, can hold the
    processes in step as DDP's all-reduces would). Collective over ``group``.

    Example::

        time_hooks([[(512, 512)]], [("bf16", 0)], make, torch.device("cpu"), group=alone)
    """
    spent = {}
    for name, rank in hooks:
        state, hook = make(name, max(rank, 1), group)
        if hasattr(state, "start_powerSGD_iter"):
            state.iter = state.start_powerSGD_iter  # no plain all-reduce warm-up here
        fake = [_Bucket(i, len(bucket_shapes), shapes, device)
                for i, shapes in enumerate(bucket_shapes)]
        times = []
        for _ in range(1 + steps):  # the first allocates PowerSGD's P, Q and error
            start = time.perf_counter()
            for bucket in fake:  # one at a time: torch's PowerSGD callbacks block gloo's threads
                hook(state, bucket).wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if after_step is not None:
                after_step()
            times.append(time.perf_counter() - start)
        kept = sorted(times[1:])
        spent[(name, rank)] = kept[len(kept) // 2] if median else kept[0]
    return spent


class _Bucket:
    """What DDP hands a comm hook (``torch.distributed.GradBucket``), made from shapes."""

    def __init__(self, index: int, count: int, shapes: Sequence[Tuple[int, ...]],
                 device: torch.device) -> None:
        sizes = [math.prod(s) for s in shapes]
        self._index, self._count = index, count
        self._buffer = torch.randn(sum(sizes), device=device)
        self._grads = [g.view(s) for g, s in zip(self._buffer.split(sizes), shapes)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list:
        return self._grads

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1
