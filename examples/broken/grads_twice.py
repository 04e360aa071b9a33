"""A planted bug for `ddpkit verify`: gradients all-reduced by hand after backward (left over
from a Horovod-style script) on top of DDP, which already averaged them: the gradients are
N times too large.

    ddpkit verify --nproc 2 examples/broken/grads_twice.py   # FAIL [gradients-reduced-twice]
"""
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
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)   # the bug: DDP has done this already
        opt.step()
