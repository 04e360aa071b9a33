"""The same script made data-parallel with ddpkit: diff it against examples/train_plain.py.

    ddpkit run --nproc 2 examples/train_ddpkit.py --epochs 5     # 2 processes
    python examples/train_ddpkit.py --epochs 5                   # still runs as 1 process
"""
import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


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

    rt = ddpkit.setup(seed=0)                                        # 1: join the job
    train_set, test_set = make_data()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    model = rt.wrap(model)                                           # 2: DDP on this rank's device
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = rt.loader(train_set, batch_size=args.batch_size)       # 3: global batch, set_epoch owned

    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = rt.to_device(x, y)                                # 4: this rank's device
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        rt.print0(f"epoch {epoch}: last loss {rt.mean(loss):.4f}")   # the mean over ranks

    result = rt.evaluate(model, test_set)                            # 5: exact, all ranks
    rt.print0(f"test accuracy {result['top1']:.2f}% on {result['count']} samples")
    if rt.is_main:
        torch.save(rt.unwrap(model).state_dict(), args.out)


if __name__ == "__main__":
    main()
