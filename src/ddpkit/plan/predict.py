"""``ddpkit plan``'s predictions: a model's gradient buckets and its measured compute time fed to
the cost model (``plan.cost``) for every node count and comm hook, and the recommendation.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .cost import BUCKET_CAP, FIRST_BUCKET, Link, StepTime, buckets, step_time

__all__ = ["Workload", "Row", "workload_of", "synthetic_workload", "model_workload",
           "measure_compute",
           "measure_flops", "measure_hook", "predict", "recommend", "HOOKS", "GAIN"]

#: The hooks compared, in the order of preference when they tie.
HOOKS = ("none", "bf16", "powersgd")
#: A hook must beat plain all-reduce by this much to be recommended: below it the gain is
#: within noise, and compression changes the numerics for nothing.
GAIN = 0.05


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


def synthetic_workload(params: int, compute_s: float, batch: int) -> Workload:
    """A model known only by its parameter count: 1024 x 1024 matrices (stated in the output).

    Example::

        synthetic_workload(25_000_000, compute_s=0.3, batch=32)
    """
    matrices, rest = divmod(params, 1024 * 1024)
    model = nn.ParameterList([nn.Parameter(torch.empty(1024, 1024, device="meta"))
                              for _ in range(matrices)] +
                             ([nn.Parameter(torch.empty(rest, device="meta"))] if rest else []))
    return workload_of(model, compute_s, batch, f"{params:,} parameters as 1024x1024 matrices")


def model_workload(name: str, batch: int, compute_s: Optional[float] = None,
                   device: Optional[torch.device] = None) -> Workload:
    """A built-in model of ``ddpkit train`` (or ``torchvision:<name>``), its forward+backward
    measured on ``device`` for ``batch`` samples unless ``compute_s`` is given.

    Example::

        model_workload("resnet18", batch=32)
    """
    from ..job.models import LANGUAGE_MODELS, build_model, model_key

    text = not name.startswith("torchvision:") and model_key(name) in LANGUAGE_MODELS
    model = build_model(name, 256 if text else 10, 1 if text else 3)
    if compute_s is None:
        device = device or torch.device("cpu")
        model = model.to(device)
        example = torch.randint(0, 256, (batch, 128), device=device) if text else \
            torch.randn(batch, 3, 32, 32, device=device)
        compute_s = measure_compute(model, example)
    return workload_of(model, compute_s, batch, name)


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
    """Seconds per step of ``hook``'s own work on this device, measured on tensors of the
    model's gradient shapes: the casts of fp16/bf16 (to half and back), PowerSGD's error feedback,
    P = MQ, orthogonalisation, Q = M^T P and the reconstruction (memory-bound on a CPU: far more
    than its flops say).

    Example::

        measure_hook(workload, "powersgd", rank=2)
    """
    if hook == "none":
        return 0.0
    device = device or torch.device("cpu")
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


def _powersgd_math(grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor) -> None:
    grad.add_(error)
    p, _ = torch.linalg.qr(grad @ q)
    q = grad.t() @ p
    error.copy_(grad - p @ q.t())


@dataclass(frozen=True)
class Row:
    """One prediction: node count, hook, the step and what it gives. Example::

        Row(2, 8, "bf16", step, samples_per_s=1024.0, efficiency=0.93)
    """

    nodes: int
    ranks: int
    hook: str
    step: StepTime
    samples_per_s: float
    efficiency: float      # throughput per rank against one rank alone


def predict(work: Workload, nodes: Sequence[int], link: Link, per_node: int = 1,
            inside: Optional[Link] = None, hooks: Sequence[str] = HOOKS, rank: int = 2,
            flops_per_s: float = 1e11,
            hook_seconds: Optional[Dict[str, float]] = None) -> List[Row]:
    """Every node count x hook. Ranks on one node talk over ``inside`` (default ``link``);
    across nodes the ring runs at the slower ``link``; ``hook_seconds`` the hooks' own compute
    as :func:`measure_hook` measured it.

    Example::

        predict(workload, [1, 2, 4], LINKS["1gbit"], per_node=1)
    """
    alone = work.compute_s
    rows = []
    for count in nodes:
        ranks = count * per_node
        over = link if count > 1 else (inside or link)
        for hook in hooks:
            step = step_time(work.compute_s, work.bucket_shapes, ranks, over, hook, rank,
                             flops_per_s, hook_s=(hook_seconds or {}).get(hook))
            rows.append(Row(count, ranks, hook, step, ranks * work.batch / step.total,
                            alone / step.total))
    return rows


def recommend(rows: Sequence[Row]) -> Dict[int, Tuple[str, float]]:
    """Per node count: the hook to use and its gain over plain all-reduce (0 for "none").

    Example::

        recommend(predict(work, [2], LINKS["100mbit"]))   # {2: ('powersgd', 3.1)}
    """
    out: Dict[int, Tuple[str, float]] = {}
    for nodes in sorted({r.nodes for r in rows}):
        mine = [r for r in rows if r.nodes == nodes]
        plain = next((r for r in mine if r.hook == "none"), mine[0])
        best = max(mine, key=lambda r: r.samples_per_s)
        gain = best.samples_per_s / plain.samples_per_s - 1
        out[nodes] = (best.hook, gain) if gain > GAIN else ("none", 0.0)
    return out
