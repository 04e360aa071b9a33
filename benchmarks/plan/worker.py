"""One rank of the plan validation: an MLP trained with DDP (and a comm hook) on synthetic data,
one thread; rank 0 prints the median step time and the model's compute time measured alone
before the process group's first collective.

    ddpkit run --nnodes 2 --nproc 1 ... benchmarks/plan/worker.py --hook bf16 --steps 12
"""
import argparse
import json
import statistics
import time

import torch
from torch import nn

import ddpkit


def mlp(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hook", default="none")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    rt = ddpkit.setup(seed=0)
    model = mlp(args.width, args.depth)
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    wrapped = rt.wrap(model, comm_hook=None if args.hook == "none" else args.hook,
                      powersgd_start_iter=2)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    measured = statistics.median(times[4:])
    if rt.is_main:
        print(json.dumps({"hook": args.hook, "step_s": measured, "params": sum(
            p.numel() for p in model.parameters())}), flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
