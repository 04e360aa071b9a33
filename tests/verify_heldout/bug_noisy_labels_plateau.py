"""Noisy-label tabular classifier with ReduceLROnPlateau on the validation loss (own
validation loop), SGD, 6 short epochs.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, BATCH = 6, 32


def make_noisy(n, seed, flip=0.25):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + x[:, 1] - x[:, 2] > 0).long()
    flips = torch.rand(n, generator=g) < flip
    return TensorDataset(x, torch.where(flips, 1 - y, y))


@torch.no_grad()
def validate(rt, model, loader):
    model.eval()
    loss_sum, count = 0.0, 0
    for x, y in loader:
        x, y = rt.to_device(x, y)
        loss_sum += F.cross_entropy(model(x), y, reduction="sum").item()
        count += len(y)
    model.train()
    return loss_sum / count


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_noisy(256, 0), make_noisy(96, 1)
    model = rt.wrap(nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                  nn.Linear(128, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.3, patience=0)
    loader = rt.loader(train_set, batch_size=BATCH)
    val_loader = rt.loader(val_set, batch_size=48, shuffle=False)

    for epoch in range(1, EPOCHS + 1):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_loss = validate(rt, model, val_loader)
        scheduler.step(val_loss)
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val_loss:.6f} "
                  f"lr {optimizer.param_groups[0]['lr']:.4f}")


if __name__ == "__main__":
    main()
