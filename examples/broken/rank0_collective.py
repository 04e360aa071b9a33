"""A planted bug for `ddpkit verify`: a checkpoint saved under `if rank == 0:` with a collective
inside it (a barrier "so that the file is complete"): rank 0 waits in the barrier while rank 1
trains on, and 2 processes hang where 1 process trains.

    ddpkit verify --nproc 2 --timeout 60 examples/broken/rank0_collective.py   # FAIL [hangs-on-n]
"""
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64)
out = tempfile.mkdtemp()
for epoch in range(2):
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rt.is_main and step == 1:   # the bug: a collective that only rank 0 reaches
            torch.save(rt.unwrap(model).state_dict(), os.path.join(out, "model.pt"))
            if dist.is_initialized():
                dist.barrier()
