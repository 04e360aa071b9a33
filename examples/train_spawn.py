"""The spawn variant: no launcher, ``ddpkit.launch`` starts the processes (handy in notebooks).

    python examples/train_spawn.py --nproc 2
"""
import argparse

import torch
from torch import nn

import ddpkit
from train_ddpkit import make_data


def train(epochs: int, batch_size: int, lr: float) -> float:
    rt = ddpkit.setup(seed=0)
    train_set, test_set = make_data()
    model = rt.wrap(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = rt.loader(train_set, batch_size=batch_size)
    for _ in range(epochs):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return rt.evaluate(model, test_set)["top1"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    accuracy = ddpkit.launch(train, args.nproc, args.epochs, 64, 0.1, timeout=600)
    print(f"test accuracy {accuracy:.2f}% ({args.nproc} processes)")


if __name__ == "__main__":
    main()
