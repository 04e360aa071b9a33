"""A planted bug for `ddpkit verify`: BatchNorm without SyncBatchNorm: each rank normalises with
its own half of the batch.

    ddpkit verify --nproc 2 --accum-steps 1 examples/broken/batchnorm.py    # FAIL [batchnorm]
    ddpkit verify --nproc 2 examples/broken/batchnorm.py    # PASS: by default a BatchNorm model
                                              # is compared with the same micro-batches
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
