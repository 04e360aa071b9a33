"""EXPECT: pass
A correct real-shaped image classifier: a small conv net with BatchNorm wrapped with
sync_bn=True where ddpkit allows it (GPUs; ddpkit refuses SyncBatchNorm on CPU, so there it is
per-rank BatchNorm and verify needs --accum-steps 2, or reports [batchnorm]), random crop and
flip in the Dataset's __getitem__ drawing from torch's global RNG, rt.loader with 2 workers,
rt.evaluate every 5 steps in the middle of training, 1000 training images with a global batch of
64 (the last batch is short), cosine schedule, label smoothing and gradient clipping.
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddpkit

CLASSES, SIZE = 6, 16


class ShapesDataset(Dataset):
    """Synthetic 3x16x16 images from a fixed seed: a class template plus noise."""

    def __init__(self, n, train, seed):
        templates = torch.randn(CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        smooth = F.interpolate(templates, size=SIZE, mode="bilinear", align_corners=False)
        self.images = smooth[self.labels] + 1.5 * torch.randn(n, 3, SIZE, SIZE, generator=g)
        self.train = train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img = self.images[i]
        if self.train:
            # RandomCrop(16, padding=2) + RandomHorizontalFlip, by hand
            dy, dx = torch.randint(0, 5, (2,)).tolist()
            img = F.pad(img, (2, 2, 2, 2), mode="reflect")[:, dy:dy + SIZE, dx:dx + SIZE]
            if torch.rand(()) < 0.5:
                img = torch.flip(img, dims=[2])
        return img, self.labels[i]


class ConvNet(nn.Module):
    def __init__(self, width=16):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))
        self.features = nn.Sequential(block(3, width), nn.MaxPool2d(2),
                                      block(width, 2 * width), nn.MaxPool2d(2),
                                      block(2 * width, 2 * width))
        self.classifier = nn.Linear(2 * width, CLASSES)

    def forward(self, x):
        x = self.features(x)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("-b", "--batch-size", type=int, default=64)
    parser.add_argument("-j", "--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=5)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    train_set = ShapesDataset(1000, train=True, seed=1)
    val_set = ShapesDataset(300, train=False, seed=2)

    model = rt.wrap(ConvNet(), sync_bn=rt.device.type == "cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=5e-4, nesterov=True)
    loader = rt.loader(train_set, batch_size=args.batch_size, num_workers=args.workers)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                           T_max=args.epochs * len(loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for images, targets in loader:
            images, targets = rt.to_device(images, targets)
            loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=2.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % args.eval_every == 0:
                metrics = rt.evaluate(model, val_set, batch_size=100, topk=(1, 2))
                model.train()
                rt.print0(f"step {step}: train loss {rt.mean(loss):.4f} | val top1 "
                          f"{metrics['top1']:.2f}% top2 {metrics['top2']:.2f}% "
                          f"({metrics['count']} images)")
    metrics = rt.evaluate(model, val_set, batch_size=100)
    rt.print0(f"final: top1 {metrics['top1']:.2f}% loss {metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
