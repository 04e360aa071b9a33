"""The same image classifier made data-parallel with ddpkit: diff it against
examples/imagenet_plain.py. Its loop is kept; the checkpointer resumes it exactly, mid-epoch too.

    ddpkit run --nproc 2 examples/imagenet_ddpkit.py --epochs 4     # 2 processes
    python examples/imagenet_ddpkit.py --epochs 4                   # still runs as 1 process
    # stopped or crashed: the same command again continues exactly where it was (mid-epoch too)
"""
import argparse
import os
import shutil

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddpkit

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
    parser.add_argument("--resume", default="auto", type=str,
                        help="checkpoint to resume from; auto: the newest in --checkpoint-dir")
    parser.add_argument("--save-every", default=10, type=int, help="also save every N steps")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--out", default="imagenet.pt", help="final weights")
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)                                         # 1: join the job
    device = rt.device
    model = rt.wrap(small_cnn())                                      # 2: DDP on this rank's device
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    use_amp = device.type == "cuda"  # float16 autocast + loss scaling on GPUs; fp32 on a CPU
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp)
    train_set = SyntheticImages(500, train=True, seed=1)
    val_set = SyntheticImages(250, train=False, seed=2)
    # 3: batch_size is the global batch; each rank loads its share, set_epoch is done for you
    train_loader = rt.loader(train_set, batch_size=args.batch_size, num_workers=args.workers)
    # 4: the whole run (weights, optimizer, scheduler, scaler, the loader's place, every rank's
    # RNG, best_acc1), saved every N steps and after each validation; resumed exactly, mid-epoch
    ckpt = rt.checkpointer(args.checkpoint_dir, model=model, optimizer=optimizer,
                           scheduler=scheduler, scaler=scaler, loader=train_loader,
                           every_steps=args.save_every, every_epoch=False, resume=args.resume,
                           extra={"best_acc1": 0.0})
    best_acc1 = ckpt.extra["best_acc1"]

    for epoch in range(ckpt.epoch, args.epochs):
        train(rt, ckpt, train_loader, model, criterion, optimizer, scaler, epoch, device, args)
        acc1 = validate(rt, model, val_set)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = ckpt.extra["best_acc1"] = max(acc1, best_acc1)
        save_checkpoint(ckpt, is_best, args.checkpoint_dir)
    ckpt.close()
    rt.print0(f"best Acc@1 {best_acc1:.3f}")
    if rt.is_main:
        torch.save(rt.unwrap(model).state_dict(), args.out)


def train(rt, ckpt, train_loader, model, criterion, optimizer, scaler, epoch, device, args):
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
        ckpt.step()                        # 5: saves when due; on SIGTERM saves, then exits 143
        if i % args.print_freq == 0:
            rt.print0(f"Epoch: [{epoch}][{i}/{len(train_loader)}] loss {rt.mean(loss):.4f}")


def validate(rt, model, val_set):
    metrics = rt.evaluate(model, val_set, per_rank_batch=64)  # 6: exact, every image once, all ranks
    rt.print0(f" * Acc@1 {metrics['top1']:.3f} Acc@5 {metrics['top5']:.3f} "
              f"loss {metrics['loss']:.4f} on {metrics['count']} images")
    return metrics["top1"]


def save_checkpoint(ckpt, is_best, directory):
    path = ckpt.save()                     # every rank; the path on rank 0
    if is_best and path is not None:
        shutil.copyfile(path, os.path.join(directory, "model_best.pt"))


if __name__ == "__main__":
    main()
