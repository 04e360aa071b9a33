"""EXPECT: unseeded per-rank shuffle
Each epoch the script shuffles the training indices itself with a generator seeded from
time.time_ns() and takes its rank's slice (order[rank::world_size]); every rank draws its own
permutation, so on 2 processes the ranks' slices overlap and miss samples, and two runs never see
the same batches: the loss curve changes from run to run even though setup(seed=0) is called.
"""
import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F

import ddpkit


def make_data(n=640, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    w = torch.randn(20, 5, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, 5, generator=g)).argmax(1)
    return x, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    x, y = make_data()
    model = rt.wrap(nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    per_rank = args.batch_size // rt.world_size
    n = len(x)

    for epoch in range(args.epochs):
        # fresh shuffle every epoch
        g = torch.Generator().manual_seed(time.time_ns() % (2 ** 62))
        order = torch.randperm(n, generator=g)
        mine = order[rt.rank::rt.world_size]
        model.train()
        for start in range(0, len(mine) - per_rank + 1, per_rank):
            idx = mine[start:start + per_rank]
            xb, yb = rt.to_device(x[idx], y[idx])
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        rt.print0(f"epoch {epoch}: loss {rt.mean(loss):.4f}")


if __name__ == "__main__":
    main()
