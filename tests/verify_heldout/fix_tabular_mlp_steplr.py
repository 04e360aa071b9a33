"""Tabular classifier: 3-layer MLP, SGD + momentum, step LR decay each epoch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def make_data(n_train=512, n_test=256, dim=20, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w + 0.5 * torch.randn(n_train + n_test, classes, generator=g)).argmax(1)
    return (TensorDataset(x[:n_train], y[:n_train]),
            TensorDataset(x[n_train:], y[n_train:]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    train_set, test_set = make_data()
    model = rt.wrap(nn.Sequential(nn.Linear(20, 64), nn.ReLU(),
                                  nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    loader = rt.loader(train_set, batch_size=args.batch_size)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(1, args.epochs + 1):
        model.train()
        running = 0.0
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item()
        scheduler.step()
        train_loss = rt.mean(running / len(loader))
        result = rt.evaluate(model, test_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {train_loss:.6f} test_loss {result['loss']:.6f} "
                  f"acc {result['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
