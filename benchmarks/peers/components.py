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
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_worker as pw  # noqa: E402  (same model, data and hyper-parameters as the peers)

Split = Tuple[float, float, float, float]
PARTS = ("data", "forward", "backward", "optimizer")


def handwritten(args: argparse.Namespace) -> Callable[[], Split]:
    model = nn.parallel.DistributedDataParallel(pw._model(args))
    opt = torch.optim.SGD(model.parameters(), lr=pw.LR, momentum=pw.MOMENTUM)
    data = pw._data(args)
    sampler = DistributedSampler(data, shuffle=True, seed=pw.SEED, drop_last=True)
    batches = iter(DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True))

    def step() -> Split:
        t0 = time.perf_counter()
        x, y = next(batches)
        t1 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3
    return step


def ddpkit_loop(args: argparse.Namespace) -> Callable[[], Split]:
    import ddpkit
    rt = ddpkit.setup(seed=pw.SEED)
    torch.set_num_threads(args.threads)
    model = rt.wrap(pw._model(args))
    opt = torch.optim.SGD(model.parameters(), lr=pw.LR, momentum=pw.MOMENTUM)
    loader = rt.loader(pw._data(args), batch_size=args.batch * rt.world_size, seed=pw.SEED,
                       drop_last=True)
    acc = ddpkit.Accumulator(model, opt, ddpkit.Precision("fp32", rt.device))
    batches = iter(loader)

    def step() -> Split:
        t0 = time.perf_counter()
        x, y = rt.to_device(*next(batches))
        t1 = time.perf_counter()
        with acc.micro_step():
            with acc.precision.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            t2 = time.perf_counter()
            acc.backward(loss)
            t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3  # optimizer: on exit
    return step


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
    builders = [("ddpkit", ddpkit_loop), ("handwritten", handwritten)]
    if not args.ddpkit_first:
        builders.reverse()
    steps = {name: build(args) for name, build in builders}
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
