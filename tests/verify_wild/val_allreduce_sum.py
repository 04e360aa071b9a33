"""EXPECT: validation metrics summed over ranks, not averaged
After each epoch every rank computes the validation loss and accuracy on its own shard, the
script all-reduces them with SUM and rank 0 prints them without dividing by the world size: on 2
processes the printed validation loss and accuracy are about twice the true ones (accuracy over
100%), while training itself is the same as on 1 process.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddpkit

EPOCHS = 2
BATCH = 32


def blobs(n, seed):
    """8x8 one-channel 'images': one of four quadrants brighter, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = 2.5 * torch.randn(n, 1, 8, 8, generator=g)
    for c in range(4):
        r, col = divmod(c, 2)
        x[y == c, :, 4 * r:4 * r + 4, 4 * col:4 * col + 4] += 0.6
    return TensorDataset(x, y)


rt = ddpkit.setup(seed=0)
train_set, val_set = blobs(512, seed=1), blobs(256, seed=2)

model = rt.wrap(nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(8 * 4 * 4, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
train_loader = rt.loader(train_set, batch_size=BATCH)

if dist.is_initialized():
    val_sampler = DistributedSampler(val_set, shuffle=False)
else:
    val_sampler = None
val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler)


def validate():
    model.eval()
    total_loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in val_loader:
            x, y = rt.to_device(x, y)
            out = model(x)
            total_loss += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            seen += len(y)
    model.train()
    stats = torch.tensor([total_loss / seen, 100.0 * correct / seen], device=rt.device)
    if dist.is_initialized():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return stats[0].item(), stats[1].item()


for epoch in range(EPOCHS):
    model.train()
    for x, y in train_loader:
        x, y = rt.to_device(x, y)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    val_loss, val_acc = validate()
    rt.print0(f"epoch {epoch}: train loss {rt.mean(loss):.4f} | val loss {val_loss:.4f} "
              f"val acc {val_acc:.2f}%")
