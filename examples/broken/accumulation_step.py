"""A planted bug for `ddpkit verify`: accumulation that steps on the wrong micro-step (i % K == 0
steps after the first micro-batch, then every K).

    ddpkit verify --nproc 2 examples/broken/accumulation_step.py   # FAIL [accumulation-step]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
accum = 4 // rt.world_size
loader = rt.loader(data, 16 * rt.world_size)
for epoch in range(2):
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y) / accum
        loss.backward()
        if i % accum == 0:                      # the bug: (i + 1) % accum == 0
            opt.step()
            opt.zero_grad()
