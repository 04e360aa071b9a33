"""Image classifier whose module computes its own loss (label smoothing) when given targets,
Hugging Face style; SGD, StepLR per epoch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, BATCH, LR = 3, 32, 0.1


def make_blobs(n, seed, size=10):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    img = 0.5 * torch.randn(n, 1, size, size, generator=g)
    r = torch.randint(1, size - 4, (n, 2), generator=g)
    for i in range(n):
        a, b = int(r[i, 0]), int(r[i, 1])
        w = 2 + int(y[i])
        img[i, 0, a:a + w, b:b + w] += 2.5
    return TensorDataset(img, y)


class BlobNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Linear(32, 3)

    def forward(self, x, targets=None):
        logits = self.classifier(self.features(x).flatten(1))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets, label_smoothing=0.1)


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_blobs(384, 0), make_blobs(192, 1)
    model = rt.wrap(BlobNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.3)
    loader = rt.loader(train_set, batch_size=BATCH)

    for epoch in range(1, EPOCHS + 1):
        model.train()
        for images, targets in loader:
            images, targets = rt.to_device(images, targets)
            loss = rt.unwrap(model)(images, targets=targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
        val = rt.evaluate(model, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"acc {val['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
