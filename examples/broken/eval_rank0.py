"""A planted bug for `ddpkit verify`: validation on rank 0 only, over rank 0's shard of the
validation set: the printed accuracy is measured on 1/N of the samples.

    ddpkit verify --nproc 2 examples/broken/eval_rank0.py   # FAIL [evaluation]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
val = TensorDataset(torch.randn(200, 8, generator=g), torch.randint(0, 4, (200,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64)
val_loader = rt.loader(val, 50, shuffle=False)
for epoch in range(2):
    model.train()
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rt.is_main:   # the bug: rank 0 alone, on its own shard
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                correct += (model(x).argmax(1) == y).sum().item()
                total += len(y)
        print(f"epoch {epoch}: val accuracy {100 * correct / total:.2f}%")
