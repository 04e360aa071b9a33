"""Small CNN with GroupNorm on synthetic digit-like glyphs, augmentation in the Dataset
(random flip, shift and noise from a per-sample generator), 2 loader workers, a first pass
over the loader to report the class balance, own validation loop.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddpkit

EPOCHS, BATCH, SIZE, CLASSES = 3, 32, 10, 4


def glyphs(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    img = torch.zeros(n, 1, SIZE, SIZE)
    img[y == 0, 0, 2:8, 4:6] = 1.0
    img[y == 1, 0, 4:6, 2:8] = 1.0
    img[y == 2, 0, 2:8, 2:8] = 1.0
    img[y == 2, 0, 3:7, 3:7] = 0.0
    img[y == 3, 0, 2:8, 2:4] = 1.0
    img[y == 3, 0, 6:8, 2:8] = 1.0
    return img, y


class Glyphs(Dataset):
    def __init__(self, n, seed, augment):
        self.img, self.y = glyphs(n, seed)
        self.seed, self.augment, self.epoch = seed, augment, 0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, idx):
        x = self.img[idx]
        if self.augment:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 10_007 + idx)
            if torch.rand((), generator=g) < 0.5:
                x = x.flip(-1).flip(-2)
            shift = torch.randint(-1, 2, (2,), generator=g).tolist()
            x = torch.roll(x, shifts=shift, dims=(-2, -1))
            x = x + 0.4 * torch.randn(x.shape, generator=g)
        return x, self.y[idx]


class GNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16)
        self.c2, self.n2 = nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(8, 32)
        self.fc = nn.Linear(32, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.n1(self.c1(x))), 2)
        x = F.relu(self.n2(self.c2(x)))
        return self.fc(x.mean((-2, -1)))


@torch.no_grad()
def validate(rt, model, loader):
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64)
    for x, y in loader:
        x, y = rt.to_device(x, y)
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum").item()
        stats[1] += (logits.argmax(1) == y).sum().item()
        stats[2] += len(y)
    model.train()
    loss_sum, correct, count = rt.reduce(stats, "sum").tolist()
    return loss_sum / count, correct / count


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = Glyphs(384, 1, augment=True), Glyphs(160, 2, augment=False)
    model = rt.wrap(GNNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2], gamma=0.2)
    loader = rt.loader(train_set, batch_size=BATCH, num_workers=2, persistent_workers=False)
    val_loader = rt.loader(val_set, batch_size=BATCH, shuffle=False)

    counts = torch.zeros(CLASSES, dtype=torch.long)
    for _, y in loader:
        counts += torch.bincount(y, minlength=CLASSES)
    counts = rt.reduce(counts, "sum")
    rt.print0("class counts " + " ".join(str(c) for c in counts.tolist()))

    for epoch in range(1, EPOCHS + 1):
        train_set.epoch = epoch
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
        val_loss, val_acc = validate(rt, model, val_loader)
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val_loss:.6f} "
                  f"acc {val_acc:.4f}")


if __name__ == "__main__":
    main()
