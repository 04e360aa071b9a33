"""MLP classifier with hand-written gradient accumulation (no_sync off the boundary),
AdamW with separate weight-decay groups, warmup + cosine LR per optimizer step, clipping,
a log line every 8 optimizer steps.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import math
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, GLOBAL_BATCH, ACCUM, WARMUP = 3, 128, 4, 4
LR, WD = 4e-3, 0.05


def make_data(n, seed):
    centers = 1.5 * torch.randn(5, 16, generator=torch.Generator().manual_seed(77))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 5, (n,), generator=g)
    return TensorDataset(centers[y] + 1.4 * torch.randn(n, 16, generator=g), y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm = nn.Linear(16, 96), nn.LayerNorm(96)
        self.fc2 = nn.Linear(96, 5)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def main():
    rt = ddpkit.setup(seed=0)
    ddp = rt.world_size > 1
    train_set, val_set = make_data(1024, 0), make_data(320, 1)
    model = rt.wrap(Net())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    loader = rt.loader(train_set, batch_size=GLOBAL_BATCH, accum_steps=ACCUM)
    total_steps = EPOCHS * len(loader) // ACCUM

    def schedule(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, total_steps - WARMUP)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    step = 0
    for epoch in range(1, EPOCHS + 1):
        model.train()
        for i, (x, y) in enumerate(loader):
            x, y = rt.to_device(x, y)
            boundary = (i + 1) % ACCUM == 0
            with model.no_sync() if ddp and not boundary else nullcontext():
                loss = F.cross_entropy(model(x), y)
                (loss / ACCUM).backward()
            if boundary:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step % 8 == 0:
                    rt.print0(f"step {step} loss {rt.mean(loss):.6f} grad_norm {grad_norm:.6f} "
                              f"lr {scheduler.get_last_lr()[0]:.6f}")
        val = rt.evaluate(model, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"acc {val['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
