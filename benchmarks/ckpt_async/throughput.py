"""Training throughput with a checkpoint every 30 s against none (issue 36, item 7): 2 ranks,
DDP, synchronous and asynchronous saves, measured side by side in one job.

    python benchmarks/ckpt_async/throughput.py --window 60 --rounds 4

ResNet-18 (CIFAR-style, 100 classes; SGD with momentum, so a checkpoint is ~90 MB) on synthetic
3x32x32 batches of 8 a rank (~0.45 s steps), one thread a rank. One job of 2 processes trains
through windows of ``--window`` seconds in turn: none, sync, async, none, ... (``rounds`` times
each), so the machine's drift (this VM's speed moves by up to ~45 % within minutes) falls on
every mode alike. In a sync or async window the run saves every 30 s (at 15 s and 45 s into a
60 s window) with a checkpointer of that kind; an async window ends by waiting for its last
write outside the timing (written long before: it takes ~0.3 s). Rank 0's clock decides, so
every rank saves and ends a window at the same step. Prints one JSON line per window and the
ratio of each mode's steps/s to the none windows of the same round.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import ddpkit
from ddpkit.job.models import resnet18


def run(window: float, every: float, rounds: int, root: str) -> list:
    torch.set_num_threads(1)
    rt = ddpkit.setup()
    torch.manual_seed(0)
    model = rt.wrap(resnet18(num_classes=100))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 100, (8,))
    savers = {mode: rt.checkpointer(os.path.join(root, mode), model=model, optimizer=opt,
                                    keep=1, resume=None, async_save=mode == "async")
              for mode in ("sync", "async")}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for _ in range(5):
        step()
    rows, total = [], 0
    for r in range(rounds):
        for mode in ("none", "sync", "async"):
            rt.barrier()
            began, steps, saves = time.monotonic(), 0, 0
            while True:
                step()
                steps, total = steps + 1, total + 1
                elapsed = rt.broadcast_object(time.monotonic() - began)
                if mode != "none" and elapsed >= every / 2 + saves * every:
                    savers[mode].global_step = total
                    savers[mode].save()
                    saves += 1
                if elapsed >= window:
                    break
            took = time.monotonic() - began
            if mode == "async":
                savers[mode].wait()
            rows.append({"round": r, "mode": mode, "steps_per_s": steps / took,
                         "steps": steps, "seconds": took, "saves": saves})
            if rt.is_main:
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in rows[-1].items()}), flush=True)
    for saver in savers.values():
        saver.close()
    return rows if rt.is_main else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--every", type=float, default=30.0, help="seconds between saves")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="ckpt-tput-")
    try:
        rows = ddpkit.launch(run, 2, args.window, args.every, args.rounds, root,
                             timeout=int(args.window * 3 * args.rounds * 2 + 300))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = {"sync": [], "async": []}
    for r in range(args.rounds):
        rate = {row["mode"]: row["steps_per_s"] for row in rows if row["round"] == r}
        for mode in ratios:
            ratios[mode].append(rate[mode] / rate["none"])
    print(json.dumps({mode: {"median_vs_none": round(statistics.median(v), 4),
                             "per_round": [round(x, 4) for x in v]}
                      for mode, v in ratios.items()}), flush=True)


if __name__ == "__main__":
    main()
