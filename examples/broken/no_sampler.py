"""A planted bug for `ddpkit verify`: a plain DataLoader(shuffle=True) and no sampler at all, so
every rank trains on the same samples: N processes do the work of one (and the loss curve looks
exactly like the 1-process one, so nothing seems wrong).

    ddpkit verify --nproc 2 examples/broken/no_sampler.py   # FAIL [same-samples]
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(data, batch_size=64, shuffle=True)   # the bug: no DistributedSampler
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
