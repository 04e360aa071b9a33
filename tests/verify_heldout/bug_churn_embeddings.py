"""Tabular model with categorical embeddings + numeric features (churn-style binary target),
evaluated on a held-out split after every epoch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddpkit

EPOCHS = 3
BATCH = 64
CARDS = (7, 5, 11)


class Customers(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.cat = torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDS], 1)
        self.num = torch.randn(n, 6, generator=g)
        score = self.num[:, 0] - 0.7 * self.num[:, 3] + 0.3 * (self.cat[:, 0] % 3).float()
        self.y = (score + 0.5 * torch.randn(n, generator=g) > 0.3).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (self.cat[i], self.num[i]), self.y[i]


class TabularNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, 4) for c in CARDS)
        self.mlp = nn.Sequential(nn.Linear(4 * len(CARDS) + 6, 48), nn.ReLU(),
                                 nn.Linear(48, 2))

    def forward(self, inputs):
        cat, num = inputs
        feats = [emb(cat[:, j]) for j, emb in enumerate(self.embs)]
        return self.mlp(torch.cat(feats + [num], 1))


def test(rt, model, test_set):
    loader = rt.loader(test_set, batch_size=100, shuffle=False)
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for inputs, y in loader:
            inputs, y = rt.to_device(inputs, y)
            logits = model(inputs)
            stats += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                   (logits.argmax(1) == y).sum().item(), len(y)],
                                  dtype=torch.float64)
    loss_sum, correct, count = rt.reduce(stats, "sum").tolist()
    model.train()
    return loss_sum / count, correct / count, int(count)


def main():
    rt = ddpkit.setup(seed=0)
    train_set, test_set = Customers(640, seed=0), Customers(301, seed=1)
    model = rt.wrap(TabularNet())
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    loader = rt.loader(train_set, batch_size=BATCH)

    for epoch in range(1, EPOCHS + 1):
        for inputs, y in loader:
            inputs, y = rt.to_device(inputs, y)
            loss = F.cross_entropy(model(inputs), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        test_loss, test_acc, n = test(rt, model, test_set)
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} test_loss {test_loss:.6f} "
                  f"acc {test_acc:.4f} n {n}")


if __name__ == "__main__":
    main()
