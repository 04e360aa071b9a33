"""What a small all-reduce costs between 2 CPU ranks on this host, and why (issue 34, item 11).

    torchrun --nproc-per-node 2 benchmarks/plan/small_message.py
    chrt -r 1 torchrun --nproc-per-node 2 benchmarks/plan/small_message.py   # real-time ranks

Each row: a barrier, then 0 or 10 ms of matrix products on both ranks (a step's compute), then
one or two all-reduces of 1 KiB (a step's last bucket, a PowerSGD's P and Q), timed on each
rank; the slowest rank's time, its mean and quantiles over ``--repeats``. Run as it is, a small
all-reduce on this 2-vCPU VM takes either ~0.3 ms or ~4 ms: gloo's network thread, woken when
the peer's bytes arrive, waits for a core that a rank's thread is computing on (the kernel is
built PREEMPT_NONE, HZ=250: up to a tick). Under ``chrt -r 1`` the ranks' threads preempt
whatever else runs and the bimodal cost is gone (``perf sched`` shows the waits: RESULTS.md).
One thread a rank (``OMP_NUM_THREADS=1``), as the benchmarks of plan run the job.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def timed(compute_ms, calls, repeats, x, a):
    out = []
    for _ in range(repeats):
        dist.barrier()
        end = time.perf_counter() + compute_ms / 1e3
        while time.perf_counter() < end:
            a @ a
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        out.append((time.perf_counter() - start) * 1e3)
    t = torch.tensor(out)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return sorted(t.tolist())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--bytes", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    x, a = torch.zeros(args.bytes // 4), torch.randn(128, 128)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"| compute before | all-reduces of {args.bytes} B | mean ms | p10 | p50 | p90 |")
        print("|---|---|---|---|---|---|")
    for compute_ms in (0, 10):
        for calls in (1, 2):
            v = timed(compute_ms, calls, args.repeats, x, a)
            q = lambda f: v[int(f * (len(v) - 1))]  # noqa: E731
            if rank0:
                print(f"| {compute_ms} ms | {calls} | {statistics.mean(v):.2f} | {q(0.1):.2f} "
                      f"| {q(0.5):.2f} | {q(0.9):.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
