"""A planted bug for `ddpkit verify`: the script shuffles its own indices each epoch from a
generator seeded by the clock, and takes its rank's slice: no two runs see the same order,
whatever setup(seed=) says.

    ddpkit verify --nproc 2 examples/broken/shuffle_unseeded.py   # FAIL [data-unseeded]
"""
import time

import torch
from torch import nn

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
x_all, y_all = torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g)
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
per_rank = 64 // rt.world_size
for epoch in range(2):
    order = torch.randperm(1024, generator=torch.Generator().manual_seed(time.time_ns()))  # bug
    for start in range(0, 1024, 64):
        idx = order[start:start + 64][rt.rank * per_rank:(rt.rank + 1) * per_rank]
        loss = nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
