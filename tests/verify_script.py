"""A real-shaped script for tests/test_verify.py, written the way users write them: BatchNorm,
augmentation in __getitem__ that draws from the global generators (torch and Python's random),
DataLoader workers or none, an uneven dataset (1000 samples), clipping imported before setup, a
scheduler stepped per batch, optionally a GradScaler, an evaluation in the middle of training, its
own loop. ``--loop-noise`` plants a bug:
noise added in the loop itself, drawn per rank.

    ddpkit verify --accum-steps 2 tests/verify_script.py --workers 2     # PASS
"""
import argparse
import random

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_  # bound before ddpkit.setup(), as scripts do
from torch.utils.data import Dataset

import ddpkit


class Shapes(Dataset):
    """Fixed 8x8 images whose augmentation (a flip, a shift, noise) is drawn at fetch time."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, 8, 8, generator=g)
        self.y = (self.x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (self.x[:, 0, 0, 0] > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        x = x.roll(random.randint(-1, 1), dims=-2)
        return x + 0.05 * torch.randn_like(x), self.y[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--loop-noise", action="store_true")
    parser.add_argument("--scaler", action="store_true", help="a GradScaler, as fp16 scripts do")
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    train, test = Shapes(1000, 0), Shapes(203, 1)
    model = rt.wrap(nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Flatten(), nn.Dropout(0.2), nn.Linear(8 * 64, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = rt.loader(train, batch_size=32, num_workers=args.workers)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=10 * len(loader))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=args.scaler)
    step = 0
    for epoch in range(10):
        for x, y in loader:
            if args.loop_noise:
                x = x + 0.1 * torch.randn_like(x)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 2 == 0:
                model.eval()
                rt.print0(f"step {step}: top-1 {rt.evaluate(model, test)['top1']:.1f}%")
                model.train()


if __name__ == "__main__":
    main()
