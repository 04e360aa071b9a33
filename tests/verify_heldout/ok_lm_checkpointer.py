"""Character-level transformer LM on the bytes of the standard library's difflib source,
AdamW + per-batch cosine schedule, saved with ddpkit's checkpointer every 8 steps and each
epoch, validation loss / perplexity per epoch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import difflib
import inspect
import math
import shutil
import tempfile

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

CONTEXT, DIM, EPOCHS, BATCH = 32, 48, 2, 32
N_TRAIN, N_VAL = 320, 64


def windows():
    raw = torch.tensor(list(inspect.getsource(difflib).encode()), dtype=torch.long)
    n = N_TRAIN + N_VAL
    x = raw[: n * CONTEXT].view(n, CONTEXT)
    y = raw[1: n * CONTEXT + 1].view(n, CONTEXT)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


class CharTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, DIM), nn.Embedding(CONTEXT, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2)
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, 256)

    def forward(self, ids):
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        return self.head(self.ln(self.body(h, mask=mask, is_causal=True)))


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = windows()
    model = rt.wrap(CharTransformer())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = rt.loader(train_set, batch_size=BATCH)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS * len(loader),
                                                           eta_min=3e-4)
    run_dir = rt.broadcast_object(tempfile.mkdtemp(prefix="lm_run_") if rt.is_main else None)
    ckpt = rt.checkpointer(run_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                           loader=loader, every_steps=8, resume=None)

    for epoch in range(ckpt.epoch, EPOCHS):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            ckpt.step()
        val = rt.evaluate(model, val_set, batch_size=32, topk=(1,))
        rt.print0(f"epoch {epoch + 1} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"ppl {math.exp(val['loss']):.4f} char_acc {val['top1'] / 100:.4f}")
    ckpt.close()
    rt.barrier()
    if rt.is_main:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
