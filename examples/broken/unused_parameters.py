"""A planted bug for `ddpkit verify`: an auxiliary head used on rank 0 only, so its parameters get
no gradient on the other ranks (DDP cannot finish its reduction).

    ddpkit verify --nproc 2 examples/broken/unused_parameters.py   # FAIL [unused-parameters]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


class Net(nn.Module):
    def __init__(self, aux: bool):
        super().__init__()
        self.body, self.head, self.aux_head = nn.Linear(8, 32), nn.Linear(32, 4), nn.Linear(32, 4)
        self.aux = aux

    def forward(self, x):
        h = torch.relu(self.body(x))
        out = self.head(h)
        return out + 0.1 * self.aux_head(h) if self.aux else out


rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(Net(aux=rt.is_main))   # the bug: a head for rank 0 only
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
