"""EXPECT: validation on rank 0's shard only
Validation runs inside `if rt.is_main:` over rank 0's share of a validation loader made with
rt.loader, with no collective: on 2 processes the printed validation loss and accuracy cover only
half of the validation set (rank 1's half is never scored), so they differ from the 1-process
numbers although training is the same.
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    teacher = torch.randn(10, 3, generator=torch.Generator().manual_seed(99))
    y = (x @ teacher).argmax(1)
    flip = torch.rand(n, generator=g) < 0.1            # 10% label noise
    y[flip] = torch.randint(0, 3, (int(flip.sum()),), generator=g)
    return TensorDataset(x, y)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        n += y.numel()
    model.train()
    return loss_sum / n, 100.0 * correct / n, n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    net = nn.Sequential(nn.Linear(10, 48), nn.GELU(), nn.Linear(48, 3))
    model = rt.wrap(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    train_loader = rt.loader(make_split(480, seed=1), batch_size=args.batch_size)
    val_loader = rt.loader(make_split(200, seed=2), batch_size=50, shuffle=False)

    for epoch in range(args.epochs):
        for x, y in train_loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rt.is_main:
            val_loss, val_acc, n = evaluate(rt.unwrap(model), val_loader, rt.device)
            print(f"epoch {epoch}: val loss {val_loss:.4f}, val acc {val_acc:.2f}% "
                  f"({n} samples)", flush=True)


if __name__ == "__main__":
    main()
