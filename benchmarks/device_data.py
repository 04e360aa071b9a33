"""Device-resident data against a hand-written loop whose batches are already on the GPU.

    PYTHONPATH=src python benchmarks/device_data.py                 # GPU: ResNet-18, bf16
    PYTHONPATH=src python benchmarks/device_data.py --quick         # CPU smoke run (small CNN)

One process, one device. Per round, side by side and in turn (A B C, A B C, ...):

A. **hand-written**: ResNet-18 (CIFAR stem), bf16 autocast, channels_last, SGD + momentum,
   cosine schedule per step; the batches are contiguous slices of a tensor already on the GPU
   (no gather, no augmentation): the fastest a plain loop gets.
B. **ddpkit train, device data**: ``ddpkit.job.train.train`` (what ``ddpkit train`` runs on each
   rank) with the same model, precision, optimizer, schedule and global batch on synthetic data;
   ``--device-data auto`` keeps it on the GPU (shuffled gathers on the device).
C. **ddpkit train, CPU loader**: the same with ``--device-data off`` (per-item dataset + collate,
   ``--workers 0``): what ``ddpkit train`` did before.

Throughput is images per second over the timed steps: for A, ``--steps`` steps after
``--warmup``; for B and C the second epoch's ``train/samples_per_s`` (the first holds cuDNN's
autotuning and allocator warm-up). Each figure is the median over rounds; ratios are taken
within a round, then their median is reported.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from ddpkit.job.config import TrainConfig
from ddpkit.job.models import build_model
from ddpkit.job.train import train
from ddpkit.training.precision import gpu_math


def hand_written(device: torch.device, batch: int, steps: int, warmup: int, precision: str,
                 model_name: str, channels_last: bool) -> float:
    torch.manual_seed(0)
    model = build_model(model_name, 10, 3).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps + warmup)
    n_batches = 8
    x = torch.randn(n_batches * batch, 3, 32, 32, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (n_batches * batch,), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step(i: int) -> None:
        xb, yb = x[(i % n_batches) * batch:][:batch], y[(i % n_batches) * batch:][:batch]
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()

    model.train()
    for i in range(warmup):
        step(i)
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    sync(device)
    return steps * batch / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ddpkit_train(cfg: TrainConfig) -> float:
    with tempfile.TemporaryDirectory() as out:
        state = train(dataclasses.replace(cfg, output=out))
    return state.history[-1]["train/samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--epoch-batches", type=int, default=100, help="steps per epoch for B and C")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: small CNN, tiny sizes")
    p.add_argument("--skip-cpu-loader", action="store_true", help="leave out C")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.quick:
        args.model, args.batch, args.epoch_batches, args.precision = "small_cnn", 64, 8, "fp32"
    gpu_math(device)
    common = TrainConfig(nproc=1, model=args.model, data="synthetic", epochs=2,
                         synthetic_samples=args.batch * args.epoch_batches,
                         batch_size=args.batch, precision=args.precision,
                         channels_last=cuda, eval_every=0, log_every=10**9, progress=False,
                         ckpt_every_epoch=False, accelerator=device.type)
    variants = {"hand-written (batches on the device)":
                lambda: hand_written(device, args.batch, args.epoch_batches, 20, args.precision,
                                     args.model, cuda),
                "ddpkit train, device data": lambda: ddpkit_train(
                    dataclasses.replace(common, device_data="on")),
                }
    if not args.skip_cpu_loader:
        variants["ddpkit train, CPU loader"] = lambda: ddpkit_train(
            dataclasses.replace(common, device_data="off"))
    figures = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            figures[name].append(run())
    names = list(variants)
    base = figures[names[0]]
    print(f"\n{args.model}, {args.precision}, batch {args.batch}, {device} "
          f"({torch.cuda.get_device_name(0) if cuda else 'CPU'}), torch {torch.__version__}, "
          f"{args.rounds} rounds (A B C in turn)")
    print(f"{'variant':40s} {'img/s (median)':>15s} {'ratio to A (median)':>20s}")
    table = {}
    for name in names:
        ratios = [v / b for v, b in zip(figures[name], base)]
        table[name] = {"img_s": figures[name], "median": statistics.median(figures[name]),
                       "ratio": statistics.median(ratios)}
        print(f"{name:40s} {table[name]['median']:15.0f} {table[name]['ratio']:20.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "args": vars(args), "table": table}, f, indent=2)
    assert all(math.isfinite(v["median"]) for v in table.values())


if __name__ == "__main__":
    main()
