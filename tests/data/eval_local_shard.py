"""A classifier that evaluates every epoch on its rank's share of the validation set (the
samples add up over ranks) and prints the accuracy. ``--fixed``: the correct and total counts
summed over ranks before dividing.

    ddpkit verify --steps 4 tests/data/eval_local_shard.py
"""
import argparse

import torch
from torch import nn

import ddpkit
import ddpkit.engines.comm

p = argparse.ArgumentParser()
p.add_argument("--fixed", action="store_true")
args = p.parse_args()
rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(2)
x, y = torch.randn(320, 8, generator=g), torch.randint(0, 3, (320,), generator=g)
vx, vy = torch.randn(100, 8, generator=g), torch.randint(0, 3, (100,), generator=g)
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)))
opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
loader = rt.loader(torch.utils.data.TensorDataset(x, y), batch_size=64)
for epoch in range(3):
    model.train()
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():                       # this rank's share of the validation set
        mine = slice(rt.rank, None, rt.world_size)
        correct = (model(vx[mine]).argmax(1) == vy[mine]).sum().float()
        total = torch.tensor(float(len(vy[mine])))
    if args.fixed:
        correct, total = ddpkit.engines.comm.reduce(correct), ddpkit.engines.comm.reduce(total)
    rt.print0(f"epoch {epoch} val accuracy {float(correct / total):.4f}")
