"""A planted bug for `ddpkit verify`: a fixed random projection registered as a buffer, drawn
after seeding from the rank, and wrapped with broadcast_buffers=False: every rank computes with
its own projection.

    ddpkit verify --nproc 2 examples/broken/buffer_per_rank.py   # FAIL [ranks-differ]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("proj", torch.randn(8, 16))   # drawn from the global RNG
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.head(x @ self.proj)


rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
torch.manual_seed(rt.rank)   # the bug: each rank its own "random features"
model = rt.wrap(Net(), broadcast_buffers=False)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
