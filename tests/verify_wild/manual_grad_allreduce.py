"""EXPECT: gradients all-reduced twice (summed on top of DDP)
A leftover from the script's Horovod/manual-distributed days: after loss.backward() it
all-reduces every gradient with dist.all_reduce (SUM) without dividing, on top of DDP, which has
already averaged them; on 2 processes every gradient is twice the 1-process gradient, so each
update is twice as large (gradient norms and trained weights differ from step 1).
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit


def average_gradients(model):
    """Make every rank step with the same gradient."""
    if dist.is_initialized():
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def build_model(d_in=24, hidden=64, classes=6):
    return nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.SiLU(),
                         nn.Dropout(0.0), nn.Linear(hidden, classes))


def synthetic(n, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(6, 24, generator=torch.Generator().manual_seed(123)) * 1.5
    y = torch.randint(0, 6, (n,), generator=g)
    x = centers[y] + torch.randn(n, 24, generator=g)
    return TensorDataset(x, y)


def train_one_epoch(rt, model, loader, optimizer, epoch):
    model.train()
    for i, (x, y) in enumerate(loader):
        x, y = rt.to_device(x, y)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        average_gradients(model)
        optimizer.step()
        if i % 5 == 0:
            rt.print0(f"epoch {epoch} iter {i}: loss {rt.mean(loss):.4f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    model = rt.wrap(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = rt.loader(synthetic(384, seed=1), batch_size=args.batch_size)
    for epoch in range(args.epochs):
        train_one_epoch(rt, model, loader, optimizer, epoch)
        result = rt.evaluate(model, synthetic(200, seed=2), topk=(1,))
        rt.print0(f"epoch {epoch}: val acc {result['top1']:.2f}% loss {result['loss']:.4f}")


if __name__ == "__main__":
    main()
