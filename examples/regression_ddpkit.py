"""A tabular regression with ddpkit and a training loop of its own; one exact evaluation at the end.

    ddpkit run --nproc 2 examples/regression_ddpkit.py --epochs 5     # 2 processes
    python examples/regression_ddpkit.py --epochs 5                   # still runs as 1 process

The model returns ``(B, 1)`` and the targets are float ``(B,)``: ``rt.evaluate`` sees a
regression and returns mse, mae and r2 over every validation row exactly once, whatever the
number of processes.
"""
import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

FEATURES = 8


def make_data(n: int = 3001, seed: int = 0):
    """Rows of a made-up tabular problem from a fixed seed (a linear part, an interaction, a bump
    and noise): no download needed. 601 validation rows: on 2 ranks, 301 and 300, none twice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, generator=g)
    y = x @ w + 0.5 * x[:, 0] * x[:, 1] + torch.sin(2 * x[:, 2]) + 0.1 * torch.randn(n, generator=g)
    split = int(0.8 * n)
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def make_model():
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", default="regression.pt")
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)                                        # 1: join the job
    train_set, val_set = make_data()
    model = rt.wrap(make_model())                                    # 2: DDP on this rank's device
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = rt.loader(train_set, batch_size=args.batch_size)       # 3: global batch, set_epoch owned

    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = rt.to_device(x, y)                                # 4: this rank's device
            loss = nn.functional.mse_loss(model(x).squeeze(1), y)   # (B, 1) -> (B,): no broadcast
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        rt.print0(f"epoch {epoch}: last loss {rt.mean(loss):.4f}")   # the mean over ranks

    result = rt.evaluate(model, val_set)                             # 5: exact, all ranks
    rt.print0(f"validation mse {result['mse']:.6f} mae {result['mae']:.6f} "
              f"r2 {result['r2']:.10f} on {result['count']} rows")
    if rt.is_main:
        torch.save(rt.unwrap(model).state_dict(), args.out)


if __name__ == "__main__":
    main()
