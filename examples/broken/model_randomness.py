"""A planted bug for `ddpkit verify`: dropout drawn inside the forward from a generator seeded per
rank, so the model's randomness depends on the rank.

    ddpkit verify --nproc 2 examples/broken/model_randomness.py   # FAIL [model-randomness]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(nn.functional.dropout(torch.relu(self.a(x)), 0.2, self.training))


rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
model = rt.wrap(Net())
torch.manual_seed(1234 + rt.rank)   # the bug: each rank its own dropout masks
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
