"""Where a step's time goes, hand-written DDP vs ddpkit, in one job with their steps alternating.

    torchrun --standalone --nproc-per-node 2 benchmarks/peers/components.py --steps 16
    torchrun --standalone --nproc-per-node 2 benchmarks/peers/components.py --steps 16 --ddpkit-first

Both loops are built in this process (same model, data, per-rank batch, 1 thread) and alternate
step by step (A B, B A, ...). Each step is split into data / forward / backward (with DDP's
all-reduce) / optimizer, and rank 0 prints the medians: the diagnostic behind the peers figures
in benchmarks/RESULTS.md. ``--ddpkit-first`` builds ddpkit's loop first (allocation order).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_worker as pw  # noqa: E402  (same model, data and hyper-parameters as the peers)

Split = Tuple[float, ...]
PARTS = ("data", "forward", "backward", "optimizer")


def split_step(build: Callable[..., Callable[[], None]],
               args: argparse.Namespace) -> Callable[[], Split]:
    """One of peer_worker's loops (the very code the peers measure), its step cut into PARTS at
    the phase marks it records."""
    marks: List[float] = []
    step = build(args, marks=marks)

    def timed() -> Split:
        marks[:] = [time.perf_counter()]
        step()
        marks.append(time.perf_counter())
        return tuple(b - a for a, b in zip(marks, marks[1:]))
    return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--batch", 64), ("--threads", 1), ("--steps", 16),
                          ("--epoch-size", 50_000)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--ddpkit-first", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    builders = [("ddpkit", pw.ddpkit_loop), ("handwritten", pw.handwritten)]
    if not args.ddpkit_first:
        builders.reverse()
    steps = {}
    for name, build in builders:
        steps[name] = split_step(build, args)
        torch.set_num_threads(args.threads)  # ddpkit.setup may have chosen its own
    names = list(steps)
    splits: Dict[str, List[Split]] = {n: [] for n in names}
    for i in range(args.steps + 1):  # the first pair is warm-up (DDP rebuilds its buckets)
        for name in (names if i % 2 == 0 else names[::-1]):
            split = steps[name]()
            if i:
                splits[name].append(split)
    if dist.get_rank() == 0:
        for name, rows in splits.items():
            parts = " ".join(f"{part} {1000 * statistics.median(col):.0f} ms"
                             for part, col in zip(PARTS, zip(*rows)))
            total = 1000 * statistics.median(sum(r) for r in rows)
            print(f"{name:12s} {parts}  total {total:.0f} ms (median of {len(rows)} steps)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
