"""A planted bug for `ddpkit verify`: nanoGPT-style accumulation (micro-steps per process =
K / processes) that does not divide each micro-batch's loss by the micro-steps.

    ddpkit verify --nproc 2 examples/broken/accumulation_loss.py   # FAIL [accumulation-loss]
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
accum = 4 // rt.world_size                      # global batch 64 = 16 x processes x accum
loader = rt.loader(data, 16 * rt.world_size)
for epoch in range(2):
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)   # the bug: not divided by accum
        loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
