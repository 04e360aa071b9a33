"""Small CNN on synthetic 12x12 "shape" images (a bright bar in one of four orientations).

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS = 3
BATCH_SIZE = 32
LR = 0.02


def make_images(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = 0.6 * torch.randn(n, 1, 12, 12, generator=g)
    pos = torch.randint(2, 10, (n,), generator=g)
    for i in range(n):
        p = int(pos[i])
        if y[i] == 0:
            x[i, 0, p, 2:10] += 1.5
        elif y[i] == 1:
            x[i, 0, 2:10, p] += 1.5
        elif y[i] == 2:
            x[i, 0, torch.arange(2, 10), torch.arange(2, 10)] += 1.5
        else:
            x[i, 0, torch.arange(2, 10), torch.arange(9, 1, -1)] += 1.5
    return TensorDataset(x, y)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 3 * 3, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    rt = ddpkit.setup(seed=0)
    train_set = make_images(384, seed=1)
    val_set = make_images(128, seed=2)
    model = rt.wrap(SmallCNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    train_loader = rt.loader(train_set, batch_size=BATCH_SIZE)

    for epoch in range(1, EPOCHS + 1):
        model.train()
        correct = 0
        for images, labels in train_loader:
            images, labels = rt.to_device(images, labels)
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct += (logits.argmax(1) == labels).sum().item()
        train_acc = correct / len(train_loader.dataset)
        val = rt.evaluate(model, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} train_acc {train_acc:.4f} "
                  f"val_loss {val['loss']:.6f} val_acc {val['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
