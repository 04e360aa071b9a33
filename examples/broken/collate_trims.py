"""A planted bug for `ddpkit verify`: a collate_fn that drops the last sample of every batch "to
keep shapes even": on N processes each rank drops one, so a step trains on 64 - N samples where
one process trains on 63.

    ddpkit verify --nproc 2 examples/broken/collate_trims.py   # FAIL [data-path]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

import ddpkit


def trimmed(samples):
    return default_collate(samples[:-1])   # the bug: one sample fewer per rank


rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64, collate_fn=trimmed)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
