"""An image classifier trained the way pytorch/examples imagenet/main.py trains one, shrunk to run
on a CPU in seconds: diff it against examples/imagenet_ddpkit.py.

    python examples/imagenet_plain.py --epochs 4
    python examples/imagenet_plain.py --epochs 4 --resume checkpoints/checkpoint.pt   # after a crash
"""
import argparse
import os
import shutil

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

CLASSES, SIZE = 10, 32


class SyntheticImages(Dataset):
    """An ImageNet stand-in made from a fixed seed (no download): each class a smooth colour
    template plus noise. Training images get RandomCrop(32, padding=4) and RandomHorizontalFlip,
    written by hand, drawing from the global torch RNG as torchvision's transforms do."""

    def __init__(self, n, train, seed):
        templates = torch.randn(CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        smooth = F.interpolate(templates, size=SIZE, mode="bilinear", align_corners=False)
        self.images = smooth[self.labels] + 2.0 * torch.randn(n, 3, SIZE, SIZE, generator=g)
        self.train = train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        if self.train:
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = F.pad(image, (4, 4, 4, 4))[:, top:top + SIZE, left:left + SIZE]
            if torch.rand(1).item() < 0.5:
                image = image.flip(2)
        return image, self.labels[i]


def small_cnn():
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True), nn.MaxPool2d(2)]
    return nn.Sequential(*block(3, 8), *block(8, 16), *block(16, 32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, CLASSES))


def main():
    parser = argparse.ArgumentParser(description="ImageNet-style training (synthetic data)")
    parser.add_argument("-j", "--workers", default=2, type=int, help="data loading workers")
    parser.add_argument("--epochs", default=4, type=int)
    parser.add_argument("-b", "--batch-size", default=32, type=int)
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, dest="lr")
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("-p", "--print-freq", default=10, type=int)
    parser.add_argument("--resume", default="", type=str, help="path to latest checkpoint")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--out", default="imagenet.pt", help="final weights")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = small_cnn().to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    use_amp = device.type == "cuda"  # float16 autocast + loss scaling on GPUs; fp32 on a CPU
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp)
    train_set = SyntheticImages(500, train=True, seed=1)
    val_set = SyntheticImages(250, train=False, seed=2)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=use_amp)
    val_loader = DataLoader(val_set, batch_size=64, num_workers=args.workers)

    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        if os.path.isfile(args.resume):  # whole epochs only: the checkpoint is saved after one
            print(f"=> loading checkpoint '{args.resume}'")
            checkpoint = torch.load(args.resume, map_location=device)
            start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]
            model.load_state_dict(checkpoint["state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            scaler.load_state_dict(checkpoint["scaler"])
            print(f"=> loaded checkpoint '{args.resume}' (epoch {start_epoch})")
        else:
            print(f"=> no checkpoint found at '{args.resume}'")

    for epoch in range(start_epoch, args.epochs):
        train(train_loader, model, criterion, optimizer, scaler, epoch, device, args)
        acc1 = validate(val_loader, model, criterion, device)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(),
                         "best_acc1": best_acc1, "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()},
                        is_best, args.checkpoint_dir)
    print(f"best Acc@1 {best_acc1:.3f}")
    torch.save(model.state_dict(), args.out)


def train(train_loader, model, criterion, optimizer, scaler, epoch, device, args):
    model.train()
    for i, (images, target) in enumerate(train_loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=scaler.is_enabled()):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if i % args.print_freq == 0:
            print(f"Epoch: [{epoch}][{i}/{len(train_loader)}] loss {loss.item():.4f}")


def validate(val_loader, model, criterion, device):
    model.eval()
    losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    with torch.no_grad():
        for images, target in val_loader:
            images, target = images.to(device), target.to(device)
            output = model(images)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses.update(criterion(output, target).item(), images.size(0))
            top1.update(acc1.item(), images.size(0))
            top5.update(acc5.item(), images.size(0))
    print(f" * Acc@1 {top1.avg:.3f} Acc@5 {top5.avg:.3f} loss {losses.avg:.4f} "
          f"on {top1.count} images")
    return top1.avg


def save_checkpoint(state, is_best, directory):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "checkpoint.pt")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(directory, "model_best.pt"))


class AverageMeter:
    """The running average of a value over samples."""

    def __init__(self):
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, value, n=1):
        self.sum += value * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target, topk=(1,)):
    """Percentage of targets among the top-k predictions, for each k."""
    with torch.no_grad():
        _, pred = output.topk(max(topk), 1, True, True)
        correct = pred.t().eq(target.view(1, -1))
        return [correct[:k].reshape(-1).float().sum() * (100.0 / target.size(0)) for k in topk]


if __name__ == "__main__":
    main()
