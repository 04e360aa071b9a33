"""EXPECT: collate drops every batch on 2 processes (no optimizer step)
The collate_fn returns None for a batch smaller than --batch-size (meant to skip the short last
batch of an epoch) and the loop skips None batches; rt.loader's batch_size is the global batch,
split across ranks, so on 2 processes every rank batch (16 < 32) is dropped and training takes no
optimizer step at all, while 1 process trains normally.
"""
import argparse
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset
from torch.utils.data.dataloader import default_collate

import ddpkit


def full_batches_only(batch, batch_size):
    # a short last batch makes the loss noisy: skip it
    if len(batch) < batch_size:
        return None
    return default_collate(batch)


def make_data(n=352, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()        # XOR-like
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                  nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = rt.loader(make_data(), batch_size=args.batch_size,
                       collate_fn=partial(full_batches_only, batch_size=args.batch_size))

    for epoch in range(args.epochs):
        steps, total = 0, 0.0
        for batch in loader:
            if batch is None:
                continue
            x, y = rt.to_device(*batch)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            total += loss.item()
        rt.print0(f"epoch {epoch}: {steps} steps, mean loss {total / max(steps, 1):.4f}")
    result = rt.evaluate(model, make_data(200, seed=1), topk=(1,))
    rt.print0(f"accuracy {result['top1']:.2f}% on {result['count']} samples")


if __name__ == "__main__":
    main()
