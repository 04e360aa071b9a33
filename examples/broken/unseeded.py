"""A planted bug for `ddpkit verify`: no seed, and an initialisation drawn from NumPy, whose
generator starts from a fresh seed every run: one process run twice already differs.

    ddpkit verify --nproc 2 examples/broken/unseeded.py   # FAIL [unseeded]
"""
import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup()   # the bug: setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
with torch.no_grad():
    net[0].weight.copy_(torch.from_numpy(np.random.randn(32, 8) * 0.3))
model = rt.wrap(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
