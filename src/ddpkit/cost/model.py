"""The step-time model behind ``ddpkit plan`` and ``ddpkit doctor``, pure functions: the
alpha-beta cost of a ring all-reduce, DDP's gradient buckets overlapped with the backward pass,
and what each comm hook sends and costs.

    ring all-reduce of B bytes on N ranks     t = 2(N-1) alpha + 2(N-1)/N * B / beta
    ... with doctor's sweep (R ranks)         t = (N-1)/(R-1) t_R(R B / N), t_R interpolated
                                              between the sweep's measured sizes
    nccl-tests' bandwidths                    algbw = B / t,  busbw = algbw * 2(N-1)/N
    a DDP step                                forward, then backward producing the buckets in
                                              reverse order (ready in proportion to their bytes),
                                              each bucket all-reduced once it is ready and the
                                              previous one is done; step = max(backward end,
                                              last bucket's end)
    comm that shares the compute's cores      overlap w (measured by doctor: 1 when an
                                              all-reduce runs wholly behind compute, 0 when
                                              the two take turns): step = overlapped +
                                              (1 - w) (serial - overlapped), serial = compute +
                                              hook compute + every all-reduce one after another
    a hook's own compute h, per bucket by its     half inline (DDP calls the hook on the backward's
    share of the gradients                    thread: compressing delays the backward), half in
                                              the bucket's chain after its all-reduce (the
                                              future's callbacks: decompressing)
    fp16 / bf16 hooks                         2 bytes per gradient element instead of 4
    PowerSGD, rank r                          a matrix m x n sends (m + n) r floats in two
                                              all-reduces (P, then Q) and costs 4mnr + 2mr^2
                                              flops; vectors and matrices it would not shrink
                                              2x go uncompressed, in a third all-reduce
                                              (torch's min_compression_rate)
    batched PowerSGD, rank r                  the bucket's n floats as one s x s matrix, s =
                                              ceil(sqrt(n)): sends 2 s r floats in two
                                              all-reduces and costs 4 s^2 r + 2 s r^2 flops
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["Link", "LINKS", "ring_allreduce_seconds", "bandwidths", "fit_link", "buckets",
           "HookCost", "allreduce_seconds", "hook_cost", "square_side", "StepTime", "step_time",
           "FIRST_BUCKET", "BUCKET_CAP", "GAIN", "LOWRANK_GAIN", "lowrank", "DEFAULT_RANKS"]

#: DDP's bucket sizes: the first bucket is small so communication starts early.
FIRST_BUCKET = 1 << 20
BUCKET_CAP = 25 << 20
#: PowerSGD's rank when none is given: torch's hook per tensor at 2; the batched one at 4 (one
#: matrix for a whole bucket is coarser: rank 2 lost 0.8-2 points of top-1 on the built-in job,
#: rank 4 none against the per-tensor rank 2; benchmarks/RESULTS.md).
DEFAULT_RANKS = {"powersgd": 2, "powersgd-batched": 4}
#: A hook must beat plain all-reduce by this much to be chosen: below it the gain is within
#: noise, and compression changes the numerics for nothing.
GAIN = 0.05
#: A PowerSGD must also beat every hook that sends the whole gradient (none, bf16) by this
#: much: its low-rank approximation trades accuracy (the built-in job lost 0.56 points of top-1
#: at 10 Mbit/s), and where it and bf16 are close the predictions and the real steps rank them
#: differently from run to run (100 Mbit/s between 2 namespaced nodes: the batched PowerSGD
#: predicted 5-11% faster than bf16 over 5 runs of `ddpkit plan`, measured 2-6% in training),
#: so a smaller gain is neither worth the trade nor a stable advice.
LOWRANK_GAIN = 0.15


def lowrank(hook: str) -> bool:
    """Whether ``hook`` sends a low-rank approximation of the gradient (a PowerSGD).

    Example::

        lowrank("powersgd-batched"), lowrank("bf16")   # (True, False)
    """
    return hook.startswith("powersgd")


@dataclass(frozen=True)
class Link:
    """A link between ranks: latency ``alpha`` (s per message hop), bandwidth ``beta``
    (bytes/s) and ``overlap``, the share of an all-reduce's time that can run behind the
    ranks' compute (1: NCCL beside the kernels, a NIC doing the work; lower when the copies
    and the TCP stack take the cores the ranks compute on). Example::

        Link("1gbit", alpha=50e-6, beta=117.5e6)
    """

    name: str
    alpha: float
    beta: float
    overlap: float = 1.0
    #: doctor's sweep, ``(bytes, seconds)`` of one all-reduce on ``sweep_ranks`` ranks: where
    #: given, an all-reduce costs what the sweep measured at its size (interpolated), not
    #: alpha + bytes / beta (see :func:`ring_allreduce_seconds`).
    sweep: Tuple[Tuple[float, float], ...] = ()
    sweep_ranks: int = 0

    @property
    def swept(self) -> bool:
        """Whether all-reduces are charged from :attr:`sweep` (else alpha and beta)."""
        return bool(self.sweep) and self.sweep_ranks >= 2


def _ethernet(name: str, bits_per_s: float, alpha: float = 50e-6) -> Link:
    # TCP over Ethernet carries ~94% of the line rate as payload (1448 of 1538 bytes a frame)
    return Link(name, alpha, bits_per_s / 8 * 0.94)


#: Named links for ``plan --link``: line rate, 94% of it as TCP payload, 50 us per hop (a
#: kernel TCP stack). ``doctor`` measures the real ones.
LINKS = {name: _ethernet(name, rate) for name, rate in (
    ("10mbit", 10e6), ("100mbit", 100e6), ("1gbit", 1e9), ("10gbit", 10e9), ("25gbit", 25e9),
    ("100gbit", 100e9))}


def ring_allreduce_seconds(nbytes: float, ranks: int, link: Link, calls: int = 1) -> float:
    """Time of ``calls`` ring all-reduces moving ``nbytes`` in all on ``ranks`` ranks.

    A link with doctor's sweep (measured on R ranks) charges each call what the sweep measured
    for the size whose ring moves the same chunks: a ring on N ranks takes 2(N-1) steps of B/N
    bytes, one on R ranks 2(R-1) steps of X/R, so t_N(B) = (N-1)/(R-1) t_R(R B / N), t_R
    interpolated between the sweep's sizes (the smallest's time below them, the largest's plus
    the rest of the bytes at the fitted beta beyond it). Fitted alpha and beta are a line
    through a curve: on a shaped 1 Gbit/s link between 2 namespaced nodes the sweep's 64 and
    256 KB took 2.2 and 3.8 ms, so 123 KB about 2.7 ms, where alpha + bytes / beta said 3.3.

    Example::

        ring_allreduce_seconds(100e6, 4, LINKS["10gbit"])   # ~0.128 s
    """
    if ranks <= 1:
        return 0.0
    if link.swept:
        per_call = nbytes / max(calls, 1)
        size = link.sweep_ranks * per_call / ranks
        return calls * (ranks - 1) / (link.sweep_ranks - 1) * _swept(link, size)
    return calls * 2 * (ranks - 1) * link.alpha + 2 * (ranks - 1) / ranks * nbytes / link.beta


def _swept(link: Link, size: float) -> float:
    """One all-reduce of ``size`` bytes on the sweep's ranks, from the sweep's points."""
    points = sorted(link.sweep)
    if size <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if size <= b1:
            return t0 + (t1 - t0) * (size - b0) / (b1 - b0)
    b, t = points[-1]
    share = 2 * (link.sweep_ranks - 1) / link.sweep_ranks
    return t + share * (size - b) / link.beta


def bandwidths(nbytes: float, ranks: int, seconds: float) -> Tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s as nccl-tests defines them for all-reduce.

    Example::

        bandwidths(1e9, 8, 0.5)   # (2e9, 3.5e9)
    """
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (ranks - 1) / ranks


def fit_link(sizes: Sequence[float], seconds: Sequence[float], ranks: int,
             name: str = "measured") -> Link:
    """Alpha and beta from an all-reduce sweep (sizes ascending): beta from the least-squares
    slope over the largest sizes (up to 3), alpha from what the smallest sizes (up to 3) take
    beyond their bytes at that beta (the median). One least-squares line over a whole sweep
    lets the largest messages decide the intercept too: on the same shaped link it came out
    0 us in one run and 834 us in another, where a hook's many small all-reduces pay it.

    The small sizes' bytes are taken off at the fastest rate seen (the fitted beta, or the
    sweep's best bus bandwidth where that is higher): where the largest messages move slower
    than the smaller ones (a shaper's queue, TCP backing off), their beta gave the small
    messages' bytes more than their whole time, and the latency came out 0 us on a link where
    a 1 KiB all-reduce took 337 us. At the fastest rate seen no message's bytes take longer
    than it did, so alpha is 0 only for a sweep whose messages took no time.

    Example::

        fit_link([1e3, 1e6, 1e8], [1e-4, 1e-3, 0.1], ranks=2)
    """
    if ranks < 2 or len(sizes) < 2:
        raise ValueError("fitting a link needs at least 2 ranks and 2 message sizes")
    points = sorted(zip(sizes, seconds))
    large = points[-3:]
    mean_b = sum(b for b, _ in large) / len(large)
    mean_t = sum(t for _, t in large) / len(large)
    var = sum((b - mean_b) ** 2 for b, _ in large)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in large) / var if var > 0 else 0.0
    if slope <= 0:
        return Link(name, max(0.0, min(t for _, t in points)) / (2 * (ranks - 1)), math.inf)
    share = 2 * (ranks - 1) / ranks
    beta = share / slope
    fastest = max([beta] + [share * b / t for b, t in points if t > 0])
    latency = sorted(t - share * b / fastest for b, t in points[:3])
    # 0 only where the small messages were the fastest of all: then all their time is latency
    alpha = latency[len(latency) // 2] or max(points[0][1], 0.0)
    return Link(name, max(alpha, 0.0) / (2 * (ranks - 1)), beta)


def buckets(tensor_bytes: Sequence[int], cap: int = BUCKET_CAP,
            first: int = FIRST_BUCKET) -> List[List[int]]:
    """Group gradients (in ``model.parameters()`` order) into DDP's buckets, in the order they
    become ready: reverse, the first bucket ``first`` bytes, the others ``cap``.

    Example::

        buckets([4 << 20] * 3, cap=8 << 20, first=1 << 20)   # [[2], [1, 0]] as indices
    """
    out: List[List[int]] = []
    current: List[int] = []
    size, limit = 0, first
    for index in reversed(range(len(tensor_bytes))):
        current.append(index)
        size += tensor_bytes[index]
        if size >= limit:
            out.append(current)
            current, size, limit = [], 0, cap
    if current:
        out.append(current)
    return out


@dataclass(frozen=True)
class HookCost:
    """What a hook sends for one bucket and what it computes; ``sizes``, where its calls differ
    in size, each call's bytes (see :func:`allreduce_seconds`). Example::

        hook_cost("bf16", [(512, 512)])   # HookCost(bytes=524288, calls=1, flops=0, sizes=())
    """

    bytes: float
    calls: int
    flops: float
    sizes: Tuple[float, ...] = ()


def allreduce_seconds(cost: HookCost, ranks: int, link: Link) -> float:
    """Time of the all-reduces a hook makes for one bucket: call by call where their sizes
    differ (a measured sweep is a curve: charged at their average size, a per-tensor PowerSGD's
    large uncompressed call and small P and Q came out 9% low), else ``calls`` equal parts.

    Example::

        allreduce_seconds(hook_cost("powersgd", [(1024, 1024), (1024,)]), 4, LINKS["1gbit"])
    """
    if cost.sizes:
        return sum(ring_allreduce_seconds(size, ranks, link) for size in cost.sizes)
    return ring_allreduce_seconds(cost.bytes, ranks, link, cost.calls)


def _powersgd(shape: Tuple[int, ...], rank: int) -> Tuple[float, float, bool, float]:
    """(floats sent, flops, compressed?, floats of P) for one gradient tensor."""
    numel = math.prod(shape)
    if len(shape) < 2:
        return numel, 0.0, False, 0.0
    m, n = shape[0], numel // shape[0]
    r = min(rank, m, n)
    if m * n < 2 * (m + n) * r:  # torch's min_compression_rate = 2: not worth compressing
        return numel, 0.0, False, 0.0
    return (m + n) * r, 4.0 * m * n * r + 2.0 * m * r * r, True, m * r


def square_side(numel: int) -> int:
    """The side of the square matrix batched PowerSGD (``ddpkit.cost.lowrank``) views a bucket of
    ``numel`` floats as: ceil(sqrt(numel)).

    Example::

        square_side(30_762)   # 176
    """
    return max(1, math.isqrt(max(numel - 1, 0)) + 1)


def hook_cost(hook: str, shapes: Sequence[Tuple[int, ...]], rank: int = 2) -> HookCost:
    """Bytes, all-reduce calls and extra flops of one bucket's gradients under ``hook``
    ("none", "fp16", "bf16", "powersgd" or "powersgd-batched").

    Example::

        hook_cost("powersgd", [(1024, 1024), (1024,)], rank=4)
    """
    numel = sum(math.prod(s) for s in shapes)
    if hook in ("none", None):
        return HookCost(4.0 * numel, 1, 0.0)
    if hook in ("fp16", "bf16"):
        return HookCost(2.0 * numel, 1, 0.0)
    if hook == "powersgd-batched":
        side = square_side(numel)
        r = min(rank, side)
        return HookCost(4.0 * 2 * side * r, 2, 4.0 * side * side * r + 2.0 * side * r * r)
    if hook != "powersgd":
        raise ValueError(f"unknown comm hook {hook!r}: none, fp16, bf16, powersgd or "
                         "powersgd-batched")
    parts = [_powersgd(tuple(s), rank) for s in shapes]
    floats = sum(p[0] for p in parts)
    # torch's hook: the uncompressed tensors in one all-reduce, then P, then Q
    plain = [p for p in parts if not p[2]]
    low = [p for p in parts if p[2]]
    sizes = ((4.0 * sum(p[0] for p in plain),) if plain else ()) + \
        ((4.0 * sum(p[3] for p in low), 4.0 * sum(p[0] - p[3] for p in low)) if low else ())
    return HookCost(4.0 * floats, len(sizes), sum(p[1] for p in parts), sizes)


@dataclass(frozen=True)
class StepTime:
    """One predicted step: total and its parts (seconds). Example::

        step_time(0.1, [[(1000, 1000)]], 4, LINKS["1gbit"]).total
    """

    total: float
    compute: float
    communication: float   # all-reduce time, overlapped or not
    exposed: float         # what the step waits for after its backward (and inline hook) ends
    hook_compute: float
    buffers: float = 0.0   # DDP's broadcast of the buffers before the forward


def step_time(compute_s: float, bucket_shapes: Sequence[Sequence[Tuple[int, ...]]], ranks: int,
              link: Link, hook: str = "none", rank: int = 2, flops_per_s: float = 1e11,
              forward_share: float = 1 / 3, hook_s: Optional[float] = None,
              buffer_bytes: float = 0.0) -> StepTime:
    """Predict a DDP step: ``compute_s`` is forward + backward of one rank's batch on its device,
    ``bucket_shapes`` the gradients' shapes per bucket in ready order (see :func:`buckets`);
    ``hook_s``, when measured, the hook's own compute per step (else its flops at
    ``flops_per_s``); ``buffer_bytes`` what DDP broadcasts before the forward (BatchNorm's
    statistics: a tree of log2(ranks) hops, nothing runs beside it).

    Example::

        step_time(0.2, [[(512, 512)], [(512, 512)]], ranks=4, link=LINKS["10gbit"], hook="bf16")
    """
    forward = compute_s * forward_share
    backward = compute_s - forward
    costs = [hook_cost(hook, shapes, rank) for shapes in bucket_shapes]
    extra = (hook_s if hook_s is not None else sum(c.flops for c in costs) / flops_per_s) \
        if ranks > 1 else 0.0
    grads = [sum(math.prod(s) for s in shapes) for shapes in bucket_shapes]
    total_grads = sum(grads) or 1
    done, ready, comm = 0.0, forward, 0.0
    for cost, numel in zip(costs, grads):
        share = numel / total_grads
        ready += (backward + extra / 2) * share   # the hook's compressing half, inline
        seconds = allreduce_seconds(cost, ranks, link)
        done = max(ready, done) + seconds + extra / 2 * share
        comm += seconds
    if ranks <= 1:
        return StepTime(compute_s, compute_s, 0.0, 0.0, 0.0)
    buffers = math.ceil(math.log2(ranks)) * (link.alpha + buffer_bytes / link.beta) \
        if buffer_bytes else 0.0
    backward_end = compute_s + extra / 2
    end = max(backward_end, done)
    # what could not run behind the compute (it wanted the same cores) comes after it
    serial = compute_s + extra + comm
    end += (1.0 - min(max(link.overlap, -1.0), 1.0)) * max(serial - end, 0.0)
    return StepTime(end + buffers, compute_s, comm, end - backward_end, extra, buffers)
