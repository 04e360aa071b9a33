"""A planted bug for `ddpkit verify`: a collate_fn that keeps only batches of at least 48 samples
(it meant to drop a short last batch): each rank's batch of 32 on 2 processes is dropped, so 2
processes never train.

    ddpkit verify --nproc 2 examples/broken/collate_empties.py   # FAIL [no-steps]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

import ddpkit


def full_batches(samples):
    return default_collate(samples) if len(samples) >= 48 else None   # the bug


rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64, collate_fn=full_batches)
for epoch in range(2):
    for batch in loader:
        if batch is None:
            continue
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
