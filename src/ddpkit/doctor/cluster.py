"""What ``ddpkit doctor`` measures across the ranks of a job: a collective on the group's
backend, the clocks' offsets, whether the checkpoint directory is shared, and an all-reduce sweep
(algbw and busbw as nccl-tests defines them) fitted to a latency and a bandwidth, and whether
that link moves a model's gradients within the collective timeout.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as tdist

from ..cost.measure import sync_device, time_allreduce
from ..base.errors import JobSetupError
from ..cost.model import Link, bandwidths, fit_link, ring_allreduce_seconds
from ..checkpoint.shared_dir import check_shared
from .checks import Finding

__all__ = ["collective", "clocks", "shared", "sweep", "sweep_sizes", "link_finding",
           "timeout_finding", "overlap", "overlap_finding"]

#: A sweep size is timed at most this many times (within its share of the budget): a small
#: all-reduce took either ~0.4 ms or ~4 ms on a 2-core VM, and the median of 20 put alpha at 83 us
#: on one link and 1002 us on another whose small messages cost the same; a step pays the mean.
#: The mean of 60 still moved: between 2 namespaced nodes at 1 Gbit/s, what the sweep said a
#: 123 KB all-reduce costs came out 2.37-3.94 ms over 7 doctor runs, 2.52-2.89 ms with 240 repeats
#: and an 8 s budget (alternated), and plan's step over-predicted by up to 23% after a high one.
MOST_REPEATS = 240
#: Seconds a sweep spends timing, shared by its sizes (each still timed at least 3 times).
SWEEP_BUDGET_S = 8.0


def collective(device: torch.device) -> Finding:
    """An all-reduce on the job's backend, checked; on every rank.

    Example::

        collective(torch.device("cpu"))   # ok    backend: gloo all-reduce over 2 ranks
    """
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    backend = tdist.get_backend() if tdist.is_initialized() else "none (one process)"
    ones = torch.ones(4, device=device)
    if world > 1:
        tdist.all_reduce(ones)
    if not torch.equal(ones.cpu(), torch.full((4,), float(world))):
        return Finding("backend", "FAIL", f"{backend} all-reduce over {world} ranks gave "
                                          f"{ones.tolist()}, not {world}",
                       "check the devices and the NCCL/gloo set-up (NCCL_DEBUG=INFO)")
    return Finding("backend", "ok", f"{backend} all-reduce over {world} rank(s) on {device.type}")


def clocks(rank_times: List[Tuple[float, float]]) -> Finding:
    """``(before, after)`` of each rank around one gather: rank r's offset from rank 0 is known
    to within the gather's duration. Example::

        clocks([(0.0, 0.01), (5.0, 5.01)])   # FAIL: 5 s apart
    """
    base = sum(rank_times[0]) / 2
    offsets = [sum(t) / 2 - base for t in rank_times]
    slack = max(after - before for before, after in rank_times)
    worst = max(offsets, key=abs)
    if abs(worst) > max(1.0, 2 * slack):
        return Finding("clocks", "FAIL", f"rank {offsets.index(worst)}'s clock is {worst:+.2f} s "
                                         "from rank 0's", "run NTP (chrony) on every node: logs, "
                                                          "checkpoint times and timeouts agree")
    return Finding("clocks", "ok", f"within {max(abs(worst), slack) * 1e3:.0f} ms of rank 0 on "
                                   f"all {len(rank_times)} rank(s)")


def shared(directory: Optional[str], num_nodes: int) -> Finding:
    """Is ``directory`` (checkpoints) one directory for every node? Call on every rank.

    Example::

        shared("/shared/ckpt", 2)
    """
    if not directory:
        return Finding("checkpoints", "ok", "no --output given: not checked")
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".ddpkit-doctor-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
        check_shared(directory, num_nodes, wait_s=5.0)
    except JobSetupError as exc:
        return Finding("checkpoints", "FAIL", str(exc).split(":")[0],
                       f"put --output {directory} on storage every node mounts (NFS, Lustre)")
    except OSError as exc:
        return Finding("checkpoints", "FAIL", f"{directory} is not writable here ({exc.strerror})",
                       "give an --output this user can write")
    nodes = "every node sees it" if num_nodes > 1 else "one node: sharing not needed"
    return Finding("checkpoints", "ok", f"{directory} writable; {nodes}")


def sweep_sizes(max_bytes: int, min_bytes: int = 1024) -> List[int]:
    """1 KiB, 4 KiB, ... up to ``max_bytes`` (x4 steps, float32 elements).

    Example::

        sweep_sizes(1 << 20)   # [1024, 4096, 16384, 65536, 262144, 1048576]
    """
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def sweep(device: torch.device, sizes: List[int],
          budget_s: float = SWEEP_BUDGET_S) -> List[Dict[str, Any]]:
    """Time all-reduces of each size on every rank, at least 3 times and until the size's share
    of ``budget_s`` (``budget_s / len(sizes)``) is spent, at most :data:`MOST_REPEATS`; each
    time the slowest rank's. The sizes take turns (one all-reduce of each size a round, smallest
    first, a size leaving the rounds when it is done), so a slow phase of the host falls on all
    of them alike: timed one size after another, the first small size alone took 1.8-2.5 ms on
    average where the next two took 0.5-0.6, and the latency fitted from them moved 225-991 us
    between runs on one link. A small size now follows the largest, as in a step a small
    message follows compute, and costs what it costs there (the fitted alpha came out higher:
    1086-1349 us on that link). A row: ``bytes``, ``seconds`` (the times' mean, as nccl-tests
    reports it: what a step pays where a message is sometimes slow), ``algbw`` and ``busbw``
    from it, ``median``, ``repeats``. Collective. Example::

        sweep(torch.device("cpu"), sweep_sizes(1 << 20))
    """
    if not sizes:
        return []
    world = tdist.get_world_size()
    buffers = [torch.ones(size // 4, device=device) for size in sizes]
    for buffer in buffers:
        for _ in range(3):  # warm-up: buffers, connections, caches
            tdist.all_reduce(buffer)
    times: List[List[float]] = [[] for _ in sizes]
    share = budget_s / len(sizes)

    def more(mine: List[float]) -> bool:
        return len(mine) < 3 or (len(mine) < MOST_REPEATS and sum(mine) < share)

    while True:  # every rank decides alike: they all see the same (slowest rank's) times
        active = [i for i, mine in enumerate(times) if more(mine)]
        if not active:
            break
        for i in active:
            times[i].append(time_allreduce(buffers[i]))
    rows = []
    for size, mine in zip(sizes, times):
        seconds = sum(mine) / len(mine)
        algbw, busbw = bandwidths(size, world, seconds)
        rows.append({"bytes": size, "seconds": seconds, "algbw": algbw, "busbw": busbw,
                     "median": sorted(mine)[len(mine) // 2], "repeats": len(mine)})
    return rows


def link_finding(rows: List[Dict[str, Any]], world: int) -> Tuple[Finding, Link]:
    """The fitted latency and bandwidth, and the peak bus bandwidth seen.

    Example::

        finding, link = link_finding(rows, 2)
    """
    link = fit_link([r["bytes"] for r in rows], [r["seconds"] for r in rows], world)
    peak = max(r["busbw"] for r in rows)
    if link.beta == float("inf"):   # time did not grow with size: too short a sweep to tell
        return (Finding("link", "warn", f"all-reduce over {world} ranks: alpha "
                                        f"{link.alpha * 1e6:.1f} us; the sweep's times do not "
                                        f"grow with size (peak busbw {peak / 1e6:.1f} MB/s), so "
                                        "no bandwidth could be fitted",
                        "pass a larger --max-bytes (64M)"), Link(link.name, link.alpha, peak))
    return (Finding("link", "ok", f"all-reduce over {world} ranks: alpha {link.alpha * 1e6:.1f} "
                                  f"us, beta {link.beta / 1e6:.1f} MB/s, peak busbw "
                                  f"{peak / 1e6:.1f} MB/s (ddpkit plan --link <this --json>)"),
            link)


def timeout_finding(link: Link, world: int, timeout_s: float, params: Optional[int] = None,
                    peak_busbw: Optional[float] = None) -> Finding:
    """Does this link all-reduce a model's fp32 gradients (and DDP's start-up broadcast of its
    weights, the same bytes) well within the collective timeout? Without ``params``: the largest
    model that fits. The bandwidth is the fitted one, or the sweep's peak bus bandwidth when that
    is lower (a short sweep can fit no bandwidth at all): never faster than what was seen.

    Example::

        timeout_finding(Link("slow", 1e-3, 1e5), 2, 600, params=25_000_000)   # FAIL
    """
    if peak_busbw and peak_busbw < link.beta:
        link = Link(link.name, link.alpha, peak_busbw)
    if params is None:
        nbytes = max(timeout_s / 4 - 2 * (world - 1) * link.alpha, 0) * link.beta * world / \
            (2 * (world - 1))
        return Finding("timeout", "ok", f"in a quarter of the collective timeout ({timeout_s:g} "
                                        f"s) this link all-reduces {nbytes / 1e9:,.1f} GB: fp32 "
                                        f"gradients of {nbytes / 4e6:,.0f} M parameters "
                                        "(--params checks a model)")
    seconds = ring_allreduce_seconds(4.0 * params, world, link)
    said = (f"one all-reduce of {params / 1e6:,.1f} M parameters' fp32 gradients takes "
            f"{seconds:,.1f} s over this link on {world} ranks")
    fix = (f"pass --timeout-s {max(4 * seconds, 60):.0f} or more to ddpkit train (setup(timeout="
           "...)), compress the gradients (--comm-hook auto), or use a faster link")
    if seconds > timeout_s:
        return Finding("timeout", "FAIL", f"{said}: past the collective timeout of "
                                          f"{timeout_s:g} s, the first step would time out", fix)
    if seconds > timeout_s / 4:
        return Finding("timeout", "warn", f"{said}: over a quarter of the collective timeout of "
                                          f"{timeout_s:g} s (a slower moment would time out)", fix)
    return Finding("timeout", "ok", f"{said}, within the collective timeout of {timeout_s:g} s")


def _matmuls(a: torch.Tensor, count: int) -> None:
    for _ in range(count):
        torch.mm(a, a)
    sync_device(a.device)


def overlap(device: torch.device, rows: List[Dict[str, Any]], budget_s: float = 3.0,
            longest_s: float = 0.25) -> Dict[str, float]:
    """How much of an all-reduce runs behind compute on this device: every rank times a loop of
    matrix products alone (C), the sweep's largest all-reduce that took at most ``longest_s``
    alone (M), and the two started together (B); overlap = (C + M - B) / min(C, M): 1 when
    the all-reduce hides wholly, 0 when they take turns (the copies and the TCP stack want the
    compute's cores), below 0 (down to -1) when both at once take longer than one after the
    other. The slowest rank's times, the median of the repeats. Collective.

    Example::

        overlap(torch.device("cpu"), sweep(torch.device("cpu"), sweep_sizes(16 << 20)))
    """
    fitting = [r for r in rows if r["seconds"] <= longest_s] or rows[:1]
    row = fitting[-1]
    buffer = torch.ones(row["bytes"] // 4, device=device)
    a = torch.randn((4096, 4096) if device.type == "cuda" else (256, 256), device=device)
    _matmuls(a, 3)   # warm-up
    start = time.perf_counter()
    _matmuls(a, 10)
    one = torch.tensor([(time.perf_counter() - start) / 10], dtype=torch.float64, device=device)
    tdist.all_reduce(one, op=tdist.ReduceOp.MAX)   # every rank runs the same loop
    count = max(1, round(row["seconds"] / max(float(one.item()), 1e-9)))
    samples: List[Tuple[float, float, float]] = []
    # the loop ends on figures every rank agrees on (the slowest rank's), never on a local clock
    while len(samples) < 3 or (len(samples) < 9 and sum(map(sum, samples)) < budget_s):
        tdist.barrier()
        start = time.perf_counter()
        _matmuls(a, count)
        alone = time.perf_counter() - start
        comm = time_allreduce(buffer)
        tdist.barrier()
        start = time.perf_counter()
        work = tdist.all_reduce(buffer, async_op=True)
        _matmuls(a, count)
        work.wait()
        sync_device(device)
        both = torch.tensor([alone, time.perf_counter() - start], dtype=torch.float64,
                            device=device)
        tdist.all_reduce(both, op=tdist.ReduceOp.MAX)
        samples.append((float(both[0]), comm, float(both[1])))
    shares = sorted((c + m - b) / min(c, m) for c, m, b in samples)
    c, m, b = (sorted(s[i] for s in samples)[len(samples) // 2] for i in range(3))
    return {"overlap": min(max(shares[len(shares) // 2], -1.0), 1.0), "bytes": row["bytes"],
            "compute_s": c, "allreduce_s": m, "together_s": b}


def overlap_finding(measured: Dict[str, float]) -> Finding:
    """One line for :func:`overlap`'s measurement; a warning below one half.

    Example::

        overlap_finding({"overlap": 0.1, "bytes": 1 << 24, "compute_s": 0.02,
                         "allreduce_s": 0.018, "together_s": 0.036})   # warn
    """
    share = measured["overlap"]
    said = (f"an all-reduce of {measured['bytes'] / (1 << 20):g} MiB beside compute: compute "
            f"{measured['compute_s'] * 1e3:.1f} ms, all-reduce {measured['allreduce_s'] * 1e3:.1f} "
            f"ms, both at once {measured['together_s'] * 1e3:.1f} ms: overlap {share:.2f} (" +
            (f"{share:.0%} of the shorter hides behind the other)" if share >= 0 else
             "both at once take longer than one after the other)"))
    if measured["overlap"] < 0.5:
        return Finding("overlap", "warn", f"{said}: the gradients' all-reduce takes the cores "
                                          "the backward needs, so DDP's overlap hides little",
                       "fewer bytes hide better (--comm-hook auto); on CPU leave cores free for "
                       "communication (OMP_NUM_THREADS below the cores per rank)")
    return Finding("overlap", "ok", said)
