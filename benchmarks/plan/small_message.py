"""What an all-reduce costs between 2 CPU ranks on this host right after compute, as a training
step's does, against one after a barrier, and why (issue 34, item 11).

    torchrun --nproc-per-node 2 benchmarks/plan/small_message.py
    chrt -r 1 torchrun --nproc-per-node 2 benchmarks/plan/small_message.py   # real-time ranks
    python benchmarks/plan/on_nodes.py 1gbit benchmarks/plan/small_message.py \
        --bytes 61524,123048 --compute-ms 0,4 --calls 1     # the default job's bf16 / fp32 bytes

Each timing: a barrier, then ``--compute-ms`` of matrix products on both ranks (a step's
compute), then ``--calls`` all-reduces of ``--bytes`` (a step's last bucket; two: a PowerSGD's P
and Q), timed on each rank; the slowest rank's time. Every combination is timed once a round,
in turns, ``--repeats`` rounds, so a slow phase of the host falls on all alike; each row gives
the mean and quantiles. With several sizes, the last lines say what the larger costs beyond the
smaller, with and without compute before: what halving a step's bytes saves.

Run as it is, a small all-reduce on this 2-vCPU VM takes either ~0.3 ms or ~4 ms: gloo's network
thread, woken when the peer's bytes arrive, waits for a core that a rank's thread is computing on
(the kernel is built PREEMPT_NONE, HZ=250: up to a tick). Under ``chrt -r 1`` the ranks' threads
preempt whatever else runs and the bimodal cost is gone (``perf sched`` shows the waits:
RESULTS.md). One thread a rank (``OMP_NUM_THREADS=1``), as the benchmarks of plan run the job.
"""
import argparse
import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist


def _ints(text):
    return [int(v) for v in text.split(",") if v.strip()]


def timed_once(compute_ms, calls, x, a):
    dist.barrier()
    end = time.perf_counter() + compute_ms / 1e3
    while time.perf_counter() < end:
        a @ a
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x)
    return (time.perf_counter() - start) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--bytes", default="1024", help="sizes, comma-separated (default 1024)")
    p.add_argument("--compute-ms", default="0,10", help="compute before, comma-separated")
    p.add_argument("--calls", default="1,2", help="all-reduces after it, comma-separated")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    sizes, computes, calls = _ints(args.bytes), _ints(args.compute_ms), _ints(args.calls)
    rows = list(itertools.product(computes, calls, sizes))
    xs, a = {b: torch.zeros(max(1, b // 4)) for b in sizes}, torch.randn(128, 128)
    times = {row: [] for row in rows}
    for _ in range(args.repeats):   # in turns
        for c, k, b in rows:
            times[(c, k, b)].append(timed_once(c, k, xs[b], a))
    slowest = {}
    for row in rows:
        t = torch.tensor(times[row])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[row] = sorted(t.tolist())
    if dist.get_rank() == 0:
        _report(rows, slowest, sizes, computes, calls)
    dist.destroy_process_group()


def _report(rows, slowest, sizes, computes, calls):
    print("| compute before | all-reduces | bytes | mean ms | p10 | p50 | p90 |")
    print("|---|---|---|---|---|---|---|")
    for c, k, b in rows:
        v = slowest[(c, k, b)]
        q = lambda f: v[int(f * (len(v) - 1))]  # noqa: E731
        print(f"| {c} ms | {k} | {b} | {statistics.mean(v):.2f} | {q(0.1):.2f} | "
              f"{q(0.5):.2f} | {q(0.9):.2f} |", flush=True)
    if len(sizes) > 1:
        small, large = min(sizes), max(sizes)
        for c, k in itertools.product(computes, calls):
            lo, hi = slowest[(c, k, small)], slowest[(c, k, large)]
            print(f"after {c} ms of compute, {k} call(s): {large} B cost "
                  f"{statistics.mean(hi) - statistics.mean(lo):+.2f} ms (mean), "
                  f"{statistics.median(hi) - statistics.median(lo):+.2f} ms (median) beyond "
                  f"{small} B", flush=True)


if __name__ == "__main__":
    main()
