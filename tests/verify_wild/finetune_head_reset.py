"""EXPECT: parameters re-initialised per rank after wrap
Fine-tuning style: after rt.wrap, the script calls ddpkit.seed_everything(0, rank_offset=rt.rank+1)
(so augmentation differs per rank, as the docs suggest) and only then re-initialises the
classifier head for the new task; DDP broadcast rank 0's weights at wrap time, not later, so on
2 processes each rank starts from a different head and the ranks' weights never agree: the loss
differs from the 1-process run from step 1 and the replicas stay apart.
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddpkit


class NoisyVectors(Dataset):
    """Feature vectors with additive jitter drawn in __getitem__ (augmentation)."""

    def __init__(self, n, seed, train=True):
        g = torch.Generator().manual_seed(seed)
        protos = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = protos[self.y] + 0.8 * torch.randn(n, 32, generator=g)
        self.train = train

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if self.train:
            x = x + 0.1 * torch.randn_like(x)
        return x, self.y[i]


class Classifier(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    # "pretrained" model with a 4-way head of the same shape as the new task's
    model = rt.wrap(Classifier(num_classes=4))
    ddpkit.seed_everything(0, rank_offset=rt.rank + 1)     # different augmentation per rank
    # new task: fresh head (same shape, so DDP's buckets still fit)
    head = rt.unwrap(model).head
    with torch.no_grad():
        nn.init.trunc_normal_(head.weight, std=0.1)
        head.bias.zero_()

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = rt.loader(NoisyVectors(448, seed=1), batch_size=args.batch_size)
    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        res = rt.evaluate(model, NoisyVectors(200, seed=2, train=False), topk=(1,))
        rt.print0(f"epoch {epoch}: loss {rt.mean(loss):.4f} val acc {res['top1']:.2f}%")


if __name__ == "__main__":
    main()
