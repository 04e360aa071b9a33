"""A classifier whose script evaluates on rank 0 alone every few steps (an "eval only on the main
process" habit). ``--fixed``: the same with the model put back into training mode afterwards.

    ddpkit verify --steps 6 tests/data/eval_mode_rank0.py
"""
import argparse

import torch
from torch import nn

import ddpkit

p = argparse.ArgumentParser()
p.add_argument("--fixed", action="store_true")
args = p.parse_args()
rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(256, 10, generator=g), torch.randint(0, 3, (256,), generator=g)
model = rt.wrap(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(torch.utils.data.TensorDataset(x, y), batch_size=32)
for epoch in range(2):
    model.train()
    for i, (xb, yb) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i % 2 == 1 and rt.is_main:
            net = rt.unwrap(model)
            net.eval()
            with torch.no_grad():
                acc = (net(x[:64]).argmax(1) == y[:64]).float().mean()
            print(f"step {i} accuracy {acc:.4f}")
            if args.fixed:
                net.train()
