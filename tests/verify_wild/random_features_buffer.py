"""EXPECT: rank-dependent buffer (not broadcast)
The model's fixed random-feature projection is a registered buffer drawn after
torch.manual_seed(rt.rank), and the model is wrapped with broadcast_buffers=False, so DDP never
copies rank 0's buffer to the others: on 2 processes each rank computes its features with a
different projection, and the loss and the trained weights differ from the 1-process run.
"""
import argparse
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit


class RandomFeatureNet(nn.Module):
    """Random Fourier features (fixed, not trained) followed by a small trained MLP."""

    def __init__(self, d_in=12, n_features=96, classes=3):
        super().__init__()
        self.register_buffer("proj", torch.randn(d_in, n_features))
        self.register_buffer("phase", 2 * math.pi * torch.rand(n_features))
        self.mlp = nn.Sequential(nn.Linear(n_features, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        feats = math.sqrt(2.0 / self.proj.shape[1]) * torch.cos(x @ self.proj + self.phase)
        return self.mlp(feats)


def make_data(n=512):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 12, generator=g)
    r = x[:, :2].norm(dim=1)
    y = (r > 1.0).long() + (r > 1.8).long()        # 3 rings
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    # a different stream per rank, so that every rank draws different noise
    torch.manual_seed(rt.rank)

    model = RandomFeatureNet()
    # the buffers never change during training: no need to broadcast them every forward
    model = rt.wrap(model, broadcast_buffers=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = rt.loader(make_data(), batch_size=args.batch_size)

    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        rt.print0(f"epoch {epoch}: loss {rt.mean(loss):.4f}")


if __name__ == "__main__":
    main()
