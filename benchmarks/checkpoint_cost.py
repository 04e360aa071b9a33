"""Checkpoint figures for ResNet-18: save and load time, size, and the cost of saving every N steps.

    python benchmarks/checkpoint_cost.py --rounds 3 --steps 20

Single process, CIFAR-style ResNet-18 (100 classes), SGD with momentum (so the optimizer state is
as large as the model), batch 64 of synthetic 3x32x32 images. The save is ddpkit's real one
(atomic write, fsync, CRC); the load verifies every part. Training with and without checkpoints
alternates A B A B so machine drift does not favour either.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
from ddpkit.job.models import resnet18
from ddpkit.base.seed import rng_state


def make_run(batch: int):
    torch.manual_seed(0)
    model = resnet18(num_classes=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 100, (batch,))
    return model, opt, x, y


def step(model, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def state_of(model, opt, step_no: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": [rng_state()],
            "progress": {"epoch": 0, "step": step_no}}


def timed_steps(model, opt, x, y, steps: int, every: int, directory: str) -> float:
    """Seconds for `steps` training steps, checkpointing every `every` steps (0: never)."""
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step(model, opt, x, y)
        if every and i % every == 0:
            save_checkpoint(state_of(model, opt, i), directory, i, keep=2)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, nargs="+", default=[10, 5, 1])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, opt, x, y = make_run(64)
    step(model, opt, x, y)  # creates the momentum buffers: the state has its full size
    with tempfile.TemporaryDirectory() as d:
        saves, loads, size = [], [], 0
        for i in range(args.rounds * 2):
            t = time.perf_counter()
            path = save_checkpoint(state_of(model, opt, i), d, i, keep=2)
            saves.append(time.perf_counter() - t)
            size = os.path.getsize(path)
            t = time.perf_counter()
            load_checkpoint(path)
            loads.append(time.perf_counter() - t)
        print(f"checkpoint size {size / 1e6:.1f} MB; save median {statistics.median(saves):.3f} s "
              f"(min {min(saves):.3f}, max {max(saves):.3f}); load+verify median "
              f"{statistics.median(loads):.3f} s (min {min(loads):.3f}, max {max(loads):.3f})")
        cost = {e: [] for e in args.every}
        base_steps = []
        for _ in range(args.rounds):
            for every in args.every:  # A B A B: each round measures the baseline next to each N
                base = timed_steps(model, opt, x, y, args.steps, 0, d)
                with_ckpt = timed_steps(model, opt, x, y, args.steps, every, d)
                cost[every].append(with_ckpt / base)
                base_steps.append(base / args.steps)
        step_s = statistics.median(base_steps)
        save_s = statistics.median(saves)
        print(f"\ntraining step median {step_s * 1000:.0f} ms (batch 64, {args.threads} "
              f"thread(s)); {args.steps} steps per measurement, {args.rounds} rounds\n")
        print("| checkpoint every | expected slowdown (save / (N x step)) | measured slowdown "
              "(median) | measured range |\n|---|---|---|---|")
        for every, ratios in cost.items():
            print(f"| {every} steps | {1 + save_s / (every * step_s):.3f}x | "
                  f"{statistics.median(ratios):.3f}x | {min(ratios):.3f}-{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
