"""Metric learning: an MLP embedding network trained with a CosFace-style margin head
(normalized class weights, scale s, margin m), SGD + cosine schedule per epoch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

N_CLASSES, DIM, EMB = 8, 24, 16
EPOCHS, BATCH = 3, 64


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, EMB))

    def forward(self, x):
        return F.normalize(self.net(x), dim=1)


class CosFaceHead(nn.Module):
    def __init__(self, s=10.0, m=0.2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N_CLASSES, EMB) * 0.1)
        self.s, self.m = s, m

    def logits(self, emb):
        return emb @ F.normalize(self.weight, dim=1).t()

    def forward(self, emb, labels):
        cos = self.logits(emb)
        margin = F.one_hot(labels, N_CLASSES).float() * self.m
        return F.cross_entropy(self.s * (cos - margin), labels)


def make_ids(n, seed):
    protos = torch.randn(N_CLASSES, DIM, generator=torch.Generator().manual_seed(99))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    return TensorDataset(protos[y] + 2.0 * torch.randn(n, DIM, generator=g), y)


@torch.no_grad()
def accuracy(embedder, head, dataset):
    x, y = dataset.tensors
    return (head.logits(embedder(x)).argmax(1) == y).float().mean().item()


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_ids(512, 0), make_ids(256, 1)
    embedder = rt.wrap(Embedder())
    head = rt.wrap(CosFaceHead())
    params = list(embedder.parameters()) + list(head.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS)
    loader = rt.loader(train_set, batch_size=BATCH)

    for epoch in range(1, EPOCHS + 1):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = head(embedder(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
        acc = accuracy(rt.unwrap(embedder), rt.unwrap(head), val_set)
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_acc {acc:.4f}")


if __name__ == "__main__":
    main()
