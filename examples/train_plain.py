"""A plain single-device PyTorch training script: the "before" of examples/train_ddpkit.py.

    python examples/train_plain.py --epochs 5
"""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_data(n: int = 4096, seed: int = 0):
    """Two interleaved spirals-ish classes from a fixed seed: no download needed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    y = (x @ w).argmax(dim=1)
    split = int(0.8 * n)
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--out", default="model.pt")
    args = parser.parse_args()

    torch.manual_seed(0)
    train_set, test_set = make_data()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)

    for epoch in range(args.epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: last loss {loss.item():.4f}")

    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = 100.0 * (model(x).argmax(1) == y).float().mean().item()
    print(f"test accuracy {accuracy:.2f}% on {len(y)} samples")
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
