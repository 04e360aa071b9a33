"""A planted bug for `ddpkit verify`: drop_last only when distributed, so the epoch's short last
batch is trained on 1 process and skipped on N.

    ddpkit verify --nproc 2 --steps 4 examples/broken/drop_last.py   # FAIL [loader-drop_last]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(200, 8, generator=g), torch.randint(0, 4, (200,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64, drop_last=rt.world_size > 1)   # the bug
for epoch in range(3):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
