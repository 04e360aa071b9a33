"""MLP classifier trained with gradient accumulation (4 micro-batches per optimizer step),
gradient clipping and a linear-decay LR stepped per optimizer step.

    python train.py
    ddpkit run --nproc 2 train.py
"""
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS = 3
GLOBAL_BATCH = 128
ACCUM_STEPS = 4
LR = 0.1


def make_data(n, seed):
    centers = 2.0 * torch.randn(6, 12, generator=torch.Generator().manual_seed(123))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 6, (n,), generator=g)
    x = centers[y] + 1.5 * torch.randn(n, 12, generator=g)
    return TensorDataset(x, y)


def main():
    rt = ddpkit.setup(seed=0)
    ddp = rt.world_size > 1
    train_set, val_set = make_data(1024, 0), make_data(256, 1)
    model = rt.wrap(nn.Sequential(nn.Linear(12, 64), nn.GELU(), nn.Linear(64, 6)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = rt.loader(train_set, batch_size=GLOBAL_BATCH, accum_steps=ACCUM_STEPS)
    steps_per_epoch = len(loader) // ACCUM_STEPS
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1,
                                                  total_iters=EPOCHS * steps_per_epoch)

    for epoch in range(1, EPOCHS + 1):
        model.train()
        for i, (x, y) in enumerate(loader):
            x, y = rt.to_device(x, y)
            last = (i + 1) % ACCUM_STEPS == 0
            with model.no_sync() if ddp and not last else nullcontext():
                loss = nn.functional.cross_entropy(model(x), y)
                (loss / (ACCUM_STEPS * rt.world_size)).backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        val = rt.evaluate(model, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"acc {val['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
