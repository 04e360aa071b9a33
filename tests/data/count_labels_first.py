"""A classifier that makes one pass over its training loader before training, to count its labels
(as scripts for imbalanced data do), then trains.

    ddpkit verify --steps 10 tests/data/count_labels_first.py
"""
import torch
from torch import nn

import ddpkit
import ddpkit.engines.comm

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(3)
x = torch.randn(384, 12, generator=g)
y = (torch.rand(384, generator=g) ** 2 * 4).long()          # imbalanced classes
loader = rt.loader(torch.utils.data.TensorDataset(x, y), batch_size=16)
counts = torch.zeros(4)
for _, yb in loader:                                          # count the labels first
    counts += torch.bincount(yb, minlength=4)
counts = ddpkit.engines.comm.reduce(counts, "sum")                   # over every rank's share
rt.print0("classes: " + " ".join(f"{int(c)}" for c in counts))
model = rt.wrap(nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4)))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(2):
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    rt.print0(f"epoch {epoch} loss {rt.mean(loss.detach()):.6f}")
