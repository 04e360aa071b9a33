"""EXPECT: no DistributedSampler (every rank trains on the same samples)
The training loader is a plain DataLoader(dataset, batch_size=32, shuffle=True) without a
sampler; setup(seed=0) seeds every rank alike, so on 2 processes both ranks draw the same
shuffled batches: each step averages two copies of one batch, the epoch has as many steps as on 1
process and the second process does no useful work (no speed-up, no larger effective batch).
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import ddpkit


class Stripes(Dataset):
    """12x12 single-channel images: horizontal (0), vertical (1) or diagonal (2) stripes."""

    def __init__(self, n=480, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        i = torch.arange(12).float()
        patterns = torch.stack([torch.sin(i)[:, None].expand(12, 12),
                                torch.sin(i)[None, :].expand(12, 12),
                                torch.sin(i[:, None] + i[None, :])])
        self.x = patterns[self.y].unsqueeze(1) + 0.8 * torch.randn(n, 1, 12, 12, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 3 * 3, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    model = rt.wrap(SmallNet())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = DataLoader(Stripes(), batch_size=args.batch_size, shuffle=True)

    for epoch in range(args.epochs):
        for i, (x, y) in enumerate(loader):
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if i % 5 == 0:
                rt.print0(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f}")
    result = rt.evaluate(model, Stripes(150, seed=3), topk=(1,))
    rt.print0(f"test accuracy {result['top1']:.2f}% on {result['count']} images")


if __name__ == "__main__":
    main()
