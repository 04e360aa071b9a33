"""Regression MLP (synthetic house prices), SGD with warmup + cosine LR stepped every batch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

BASE_LR = 0.02
EPOCHS = 3
GLOBAL_BATCH = 64
WARMUP = 5


def make_housing(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    coef = torch.tensor([1.5, -2.0, 0.7, 0.0, 0.3, 1.1, -0.4, 0.9])
    y = x @ coef + 0.5 * x[:, 0] * x[:, 1] + 0.2 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_housing(768, 0), make_housing(256, 1)
    model = rt.wrap(nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1), nn.Flatten(0)))
    loader = rt.loader(train_set, batch_size=GLOBAL_BATCH)
    lr = BASE_LR
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    total = EPOCHS * len(loader)

    def lr_lambda(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (total - WARMUP)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    for epoch in range(1, EPOCHS + 1):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        val = rt.evaluate(model, val_set)
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_mse {val['mse']:.6f} "
                  f"val_r2 {val['r2']:.4f} lr {scheduler.get_last_lr()[0]:.6f}")


if __name__ == "__main__":
    main()
