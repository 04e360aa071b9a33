"""EXPECT: learning rate scaled by world size
The script applies the "linear scaling rule" (lr = base_lr * world_size) although rt.loader's
batch_size is the global batch, which does not grow with the number of processes: on 2
processes the learning rate is twice the 1-process one for the same batch, so the updates and
the loss curve differ from step 1 (the first loss agrees, the weights after the step do not).
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
parser.add_argument("--base-lr", type=float, default=0.01)
parser.add_argument("--warmup", type=int, default=3)
args = parser.parse_args()

rt = ddpkit.setup(seed=0)

g = torch.Generator().manual_seed(11)
tokens = torch.randint(1, 30, (448, 16), generator=g)
lengths = torch.randint(4, 17, (448,), generator=g)
tokens[torch.arange(16)[None, :] >= lengths[:, None]] = 0          # right padding
labels = (tokens[:, 0] % 3)                                        # class from the first token
dataset = TensorDataset(tokens, labels)

model = nn.Sequential(nn.Embedding(30, 24, padding_idx=0), nn.Flatten(),
                      nn.Linear(24 * 16, 32), nn.ReLU(), nn.Linear(32, 3))
model = rt.wrap(model)

lr = args.base_lr * rt.world_size          # linear scaling rule for data-parallel training
optimizer = torch.optim.Adam(model.parameters(), lr=lr)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
loader = rt.loader(dataset, batch_size=args.batch_size)
rt.print0(f"world size {rt.world_size}, lr {lr}")

for epoch in range(args.epochs):
    for x, y in loader:
        x, y = rt.to_device(x, y)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    rt.print0(f"epoch {epoch}: loss {rt.mean(loss):.4f} lr {scheduler.get_last_lr()[0]:.4g}")
