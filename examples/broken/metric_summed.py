"""A planted bug for `ddpkit verify`: validation loss and accuracy all-reduced with SUM and
printed without dividing by the world size: on 2 processes rank 0 prints twice the values.

    ddpkit verify --nproc 2 examples/broken/metric_summed.py   # FAIL [metric-summed]
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 4, (1024,), generator=g))
val = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g))
model = rt.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = rt.loader(data, 64)
val_loader = rt.loader(val, 64, shuffle=False)
for epoch in range(2):
    model.train()
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    losses, accs = [], []
    with torch.no_grad():
        for x, y in val_loader:
            out = model(x)
            losses.append(nn.functional.cross_entropy(out, y))
            accs.append((out.argmax(1) == y).float().mean())
    metrics = torch.stack([torch.stack(losses).mean(), torch.stack(accs).mean()])
    if dist.is_initialized():
        dist.all_reduce(metrics, op=dist.ReduceOp.SUM)   # the bug: never divided
    rt.print0(f"epoch {epoch}: val loss {metrics[0]:.4f} accuracy {metrics[1]:.4f}")
