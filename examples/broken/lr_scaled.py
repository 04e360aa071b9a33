"""A planted bug for `ddpkit verify`: the learning rate multiplied by the number of processes,
although the global batch (and so the gradient) is the same.

    ddpkit verify --nproc 2 examples/broken/lr_scaled.py   # FAIL [learning-rate]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1 * rt.world_size)   # the bug
loader = rt.loader(data, 64)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
