"""Classifier with an exponential moving average (EMA) of its weights: the EMA copy is what
gets validated, early stopping on its validation loss (patience 2), best EMA weights kept.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import copy

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

MAX_EPOCHS, BATCH, PATIENCE, DECAY = 6, 64, 2, 0.9


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = ((x[:, 0] * x[:, 1] > 0).long() + (x[:, 2] > 0.5).long())
    return TensorDataset(x, y)


@torch.no_grad()
def ema_update(ema, model, decay):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.mul_(decay).add_(p.detach(), alpha=1 - decay)


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_data(768, 0), make_data(256, 1)
    model = rt.wrap(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                  nn.Linear(64, 3)))
    ema = copy.deepcopy(rt.unwrap(model)).requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = rt.loader(train_set, batch_size=BATCH)

    best_loss, best_state, bad = float("inf"), None, 0
    for epoch in range(1, MAX_EPOCHS + 1):
        model.train()
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ema_update(ema, rt.unwrap(model), DECAY)
        res = rt.evaluate(ema, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} ema_val_loss {res['loss']:.6f} "
                  f"ema_acc {res['top1'] / 100:.4f}")
        if res["loss"] < best_loss:
            best_loss, best_state, bad = res["loss"], copy.deepcopy(ema.state_dict()), 0
        else:
            bad += 1
            if bad >= PATIENCE:
                rt.print0(f"early stopping at epoch {epoch}")
                break
    ema.load_state_dict(best_state)
    final = rt.evaluate(ema, val_set, topk=(1,))
    rt.print0(f"final ema val_loss {final['loss']:.6f} acc {final['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
