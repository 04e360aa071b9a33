"""Tiny character-level transformer on the bytes of the standard library's textwrap source,
with a learning-rate schedule driven by the number of training tokens seen (linear warmup,
then cosine decay), as LLM recipes do.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import inspect
import math
import textwrap

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

CONTEXT, DIM = 32, 48
EPOCHS, BATCH = 2, 32
PEAK_LR = 3e-3
WARMUP_TOKENS = 6_000
N_TRAIN, N_VAL = 384, 64


def make_windows():
    raw = torch.tensor(list(inspect.getsource(textwrap).encode()), dtype=torch.long)
    n = N_TRAIN + N_VAL
    x = raw[: n * CONTEXT].view(n, CONTEXT)
    y = raw[1: n * CONTEXT + 1].view(n, CONTEXT)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, DIM)
        self.pos = nn.Embedding(CONTEXT, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(DIM, 256)

    def forward(self, ids):
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def lr_at(tokens_seen, total_tokens):
    if tokens_seen < WARMUP_TOKENS:
        return PEAK_LR * tokens_seen / WARMUP_TOKENS
    progress = min(1.0, (tokens_seen - WARMUP_TOKENS) / (total_tokens - WARMUP_TOKENS))
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_windows()
    model = rt.wrap(TinyGPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.95))
    loader = rt.loader(train_set, batch_size=BATCH)
    total_tokens = EPOCHS * N_TRAIN * CONTEXT

    tokens_seen = 0
    for epoch in range(1, EPOCHS + 1):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            tokens_seen += rt.reduce(x.numel(), "sum")
            for group in optimizer.param_groups:
                group["lr"] = lr_at(tokens_seen, total_tokens)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        val = rt.evaluate(model, val_set, batch_size=32, topk=())
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"ppl {math.exp(val['loss']):.4f} lr {optimizer.param_groups[0]['lr']:.6f}")


if __name__ == "__main__":
    main()
