"""Sequence classifier: 2-layer LSTM over synthetic sensor traces, Adam, own validation loop
with best-epoch tracking.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

CFG = dict(epochs=3, batch_size=32, lr=1e-2, hidden=32, seq_len=24)


def make_traces(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    t = torch.linspace(0, 6.28, CFG["seq_len"])
    freq = 1.0 + y.float()
    x = torch.sin(freq[:, None] * t[None, :] + torch.rand(n, 1, generator=g) * 6.28)
    x = x + 0.3 * (y.float()[:, None] - 1) + 0.4 * torch.randn(n, CFG["seq_len"], generator=g)
    return TensorDataset(x.unsqueeze(-1), y)


class LSTMClassifier(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lstm = nn.LSTM(1, hidden, num_layers=2, batch_first=True, dropout=0.0)
        self.out = nn.Linear(hidden, 3)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.out(h[:, -1])


@torch.no_grad()
def validate(rt, model, loader):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = rt.to_device(x, y)
        logits = model(x)
        loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        total += y.numel()
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    loss_sum, correct, total = rt.reduce(stats, "sum").tolist()
    return loss_sum / total, correct / total


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_traces(320, seed=0), make_traces(160, seed=1)
    model = rt.wrap(LSTMClassifier(CFG["hidden"]))
    optimizer = torch.optim.Adam(model.parameters(), lr=CFG["lr"])
    train_loader = rt.loader(train_set, batch_size=CFG["batch_size"])
    val_loader = rt.loader(val_set, batch_size=40, shuffle=False)

    best_acc, best_epoch = 0.0, 0
    for epoch in range(1, CFG["epochs"] + 1):
        model.train()
        for x, y in train_loader:
            x, y = rt.to_device(x, y)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_loss, val_acc = validate(rt, model, val_loader)
        if val_acc > best_acc:
            best_acc, best_epoch = val_acc, epoch
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val_loss:.6f} "
                  f"val_acc {val_acc:.4f}")
    rt.print0(f"best val_acc {best_acc:.4f} at epoch {best_epoch}")


if __name__ == "__main__":
    main()
