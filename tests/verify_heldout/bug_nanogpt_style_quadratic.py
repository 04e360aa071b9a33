"""Polynomial-feature regression / classifier on a synthetic dataset generated at start-up,
nanoGPT-style configuration block, SGD with Nesterov momentum.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

# ---- config ----
seed = 1337
n_train, n_val = 640, 256
batch_size = 64
epochs = 3
learning_rate = 0.05
# ----------------

rt = ddpkit.setup()
torch.manual_seed(seed + rt.rank)

# data: 4 classes separated by a random quadratic boundary
W1 = torch.randn(6, 4)
W2 = torch.randn(6, 4)
x_all = torch.randn(n_train + n_val, 6)
logits_true = x_all @ W1 + (x_all ** 2) @ W2 * 0.5
y_all = logits_true.argmax(1)
train_set = TensorDataset(x_all[:n_train], y_all[:n_train])
val_set = TensorDataset(x_all[n_train:], y_all[n_train:])

model = rt.wrap(nn.Sequential(nn.Linear(6, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(),
                              nn.Linear(64, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=0.9, nesterov=True)
loader = rt.loader(train_set, batch_size=batch_size)

for epoch in range(1, epochs + 1):
    for xb, yb in loader:
        xb, yb = rt.to_device(xb, yb)
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    res = rt.evaluate(model, val_set, topk=(1,))
    rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {res['loss']:.6f} "
              f"acc {res['top1'] / 100:.4f}")
