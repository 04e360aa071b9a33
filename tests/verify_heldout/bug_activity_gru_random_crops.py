"""GRU classifier for activity-recognition style windows, trained on random-length crops
(one crop length drawn per batch), validated after every epoch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ddpkit

EPOCHS, BATCH, WINDOW, MIN_CROP = 3, 32, 32, 8


def make_windows(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    t = torch.arange(WINDOW).float()
    base = torch.stack([torch.sin(0.3 * (1 + y[:, None]) * t),
                        torch.cos(0.2 * (4 - y[:, None]) * t),
                        0.1 * y[:, None].float().expand(n, WINDOW)], -1)
    return TensorDataset(base + 0.5 * torch.randn(n, WINDOW, 3, generator=g), y)


class ActivityGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 32, batch_first=True)
        self.fc = nn.Linear(32, 4)

    def forward(self, x):
        _, h = self.gru(x)
        return self.fc(h[-1])


@torch.no_grad()
def evaluate(model, dataset):
    model.eval()
    correct = 0
    for x, y in DataLoader(dataset, batch_size=64):
        correct += (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(dataset)


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_windows(384, 0), make_windows(192, 1)
    model = rt.wrap(ActivityGRU())
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    loader = rt.loader(train_set, batch_size=BATCH)

    for epoch in range(1, EPOCHS + 1):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            crop = int(torch.randint(MIN_CROP, WINDOW + 1, ()))
            start = int(torch.randint(0, WINDOW - crop + 1, ()))
            loss = F.cross_entropy(model(x[:, start:start + crop]), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        train_loss = rt.mean(loss)
        if rt.is_main:
            acc = evaluate(rt.unwrap(model), val_set)
            print(f"epoch {epoch} loss {train_loss:.6f} val_acc {acc:.4f}", flush=True)


if __name__ == "__main__":
    main()
