"""EXPECT: pass
A correct script with its own DataLoader and DistributedSampler(shuffle=True, seed=0), set_epoch
every epoch, the global batch of 64 split as 64 // world_size per rank over a dataset whose size
is a multiple of 64 (no padding), and evaluation with rt.evaluate: every step sees the same 64
samples on 2 processes as on 1, so they compute the same.
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddpkit

GLOBAL_BATCH = 64


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 4 - 2
    y = ((x[:, 0] ** 2 + x[:, 1] ** 2 < 1.5).long()
         + (x[:, 0] > 1.0).long())                       # 3 regions
    feats = torch.cat([x, x ** 2, x.prod(1, keepdim=True)], dim=1)
    return TensorDataset(feats, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    train_set = make_data(640, seed=1)
    test_set = make_data(250, seed=2)

    model = rt.wrap(nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                  nn.Linear(32, 3)))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    assert GLOBAL_BATCH % rt.world_size == 0
    sampler = DistributedSampler(train_set, num_replicas=rt.world_size, rank=rt.rank,
                                 shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=GLOBAL_BATCH // rt.world_size, sampler=sampler)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        result = rt.evaluate(model, test_set, batch_size=128, topk=(1,))
        rt.print0(f"epoch {epoch}: train loss {rt.mean(loss):.4f} test acc "
                  f"{result['top1']:.2f}% test loss {result['loss']:.4f} "
                  f"({result['count']} samples)")


if __name__ == "__main__":
    main()
