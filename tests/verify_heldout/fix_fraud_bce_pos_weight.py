"""Imbalanced binary classifier (rare positive class, ~12%): one pass over the training
loader counts the labels to set BCE's pos_weight, then train with Adam.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, BATCH = 3, 64


def make_fraud(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    logit = 1.8 * x[:, 0] + 1.2 * x[:, 1] * x[:, 2] - 3.0
    y = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return TensorDataset(x, y)


def count_labels(loader):
    pos = neg = 0
    for _, y in loader:
        pos += int(y.sum())
        neg += int((1 - y).sum())
    return torch.tensor([neg, pos], dtype=torch.float64)


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_fraud(1024, 0), make_fraud(512, 1)
    model = rt.wrap(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1), nn.Flatten(0)))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = rt.loader(train_set, batch_size=BATCH)

    counts = rt.reduce(count_labels(loader), "sum")
    pos_weight = torch.tensor([counts[0] / counts[1]], dtype=torch.float32)
    rt.print0(f"negatives {int(counts[0])} positives {int(counts[1])} "
              f"pos_weight {pos_weight.item():.4f}")
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)

    for epoch in range(1, EPOCHS + 1):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            x, y = val_set.tensors
            pred = (rt.unwrap(model)(x) > 0).float()
            recall = (pred * y).sum() / y.sum()
            precision = (pred * y).sum() / pred.sum().clamp(min=1)
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} precision {precision:.4f} "
                  f"recall {recall:.4f}")


if __name__ == "__main__":
    main()
