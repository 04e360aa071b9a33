"""A planted bug for `ddpkit verify`: a DataLoader and DistributedSampler of the script's own,
with the per-process batch of the 1-process script (so the global batch grows with N).

    ddpkit verify --nproc 2 examples/broken/own_sampler.py    # FAIL [own-sampler]
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sampler = DistributedSampler(data, num_replicas=rt.world_size, rank=rt.rank, seed=0)
loader = DataLoader(data, batch_size=64, sampler=sampler)   # the bug: 64 per process
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
