"""EXPECT: loss multiplied by world size
A Trainer class multiplies the loss by rt.world_size before backward "to compensate for DDP
averaging the gradients"; the global batch is already split by rt.loader, so on 2 processes the
gradients (and, with SGD, the updates) are twice the 1-process ones and the backpropagated loss
is twice as large.
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddpkit


class PatchDataset(Dataset):
    """1x10x10 images: a bright 3x3 patch at one of 5 horizontal positions (the label)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 5, (n,), generator=g)
        self.x = 0.6 * torch.randn(n, 1, 10, 10, generator=g)
        rows = torch.randint(0, 8, (n,), generator=g)
        for i in range(n):
            c, r = 2 * int(self.y[i]), int(rows[i])
            self.x[i, 0, r:r + 3, c:c + 3] += 1.0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixels": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 12, 3)
        self.pool = nn.AdaptiveMaxPool2d((1, 4))
        self.fc = nn.Linear(12 * 4, 5)

    def forward(self, pixels, labels=None):
        return self.fc(self.pool(F.relu(self.conv(pixels))).flatten(1))


class Trainer:
    def __init__(self, rt, model, train_set, val_set, batch_size=32, lr=0.05, epochs=2):
        self.rt = rt
        self.model = rt.wrap(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.train_loader = rt.loader(train_set, batch_size=batch_size)
        self.val_set = val_set
        self.epochs = epochs
        self.global_step = 0

    def compute_loss(self, batch):
        batch = self.rt.to_device(batch)
        logits = self.model(batch["pixels"])
        return F.cross_entropy(logits, batch["labels"])

    def training_step(self, batch):
        loss = self.compute_loss(batch)
        # DDP averages gradients over the ranks: scale back up so the step matches 1 GPU
        scaled = loss * self.rt.world_size
        self.optimizer.zero_grad()
        scaled.backward()
        self.optimizer.step()
        self.global_step += 1
        return loss.detach()

    def validate(self):
        return self.rt.evaluate(self.model, self.val_set, batch_size=64, topk=(1,))

    def fit(self):
        for epoch in range(self.epochs):
            self.model.train()
            losses = []
            for batch in self.train_loader:
                losses.append(self.training_step(batch))
            avg = self.rt.mean(torch.stack(losses).mean())
            val = self.validate()
            self.rt.print0(f"epoch {epoch} (step {self.global_step}): train loss {avg:.4f} "
                           f"val acc {val['top1']:.2f}% val loss {val['loss']:.4f}")


if __name__ == "__main__":
    rt = ddpkit.setup(seed=0)
    Trainer(rt, Net(), PatchDataset(416, seed=1), PatchDataset(160, seed=2)).fit()
