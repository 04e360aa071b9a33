"""Two-spirals classifier: MLP with OneCycleLR stepped per batch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import argparse
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def spirals(n, seed, noise=0.15):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 3 * math.pi
    y = torch.randint(0, 2, (n,), generator=g)
    sign = 1 - 2 * y.float()
    x = torch.stack([sign * t * torch.cos(t), sign * t * torch.sin(t)], 1) / (3 * math.pi)
    return TensorDataset(x + noise * torch.randn(n, 2, generator=g), y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-lr", type=float, default=0.05)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    train_set, test_set = spirals(640, seed=0), spirals(320, seed=1)
    model = rt.wrap(nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                  nn.Linear(64, 2)))
    batch_size = args.batch_size // rt.world_size
    loader = rt.loader(train_set, batch_size=batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.max_lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.max_lr,
                                                    total_steps=args.epochs * len(loader))
    for epoch in range(1, args.epochs + 1):
        model.train()
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        res = rt.evaluate(model, test_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} test_loss {res['loss']:.6f} "
                  f"acc {res['top1'] / 100:.4f} steps {len(loader)}")


if __name__ == "__main__":
    main()
