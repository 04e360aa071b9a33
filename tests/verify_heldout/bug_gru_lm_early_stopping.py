"""GRU language model: trained on fixed-length 16-token chunks, validated on whole sentences
of varying length with its own loop (token-level loss and perplexity), early stopping on it.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

VOCAB, PAD, BOS = 40, 0, 1
EPOCHS, BATCH, PATIENCE = 4, 32, 1


def progression(g, length):
    start, step = torch.randint(0, 38, (2,), generator=g).tolist()
    return [BOS] + [2 + (start + k * (1 + step % 5)) % 38 for k in range(length)]


def train_chunks(n, seed, length=16):
    g = torch.Generator().manual_seed(seed)
    seqs = torch.tensor([progression(g, length) for _ in range(n)])
    return TensorDataset(seqs[:, :-1], seqs[:, 1:])


def val_sentences(n, seed, max_len=40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((n, max_len), PAD)
    tgt = torch.full((n, max_len), -100)
    for i in range(n):
        seq = torch.tensor(progression(g, int(torch.randint(2, max_len, (1,), generator=g))))
        ids[i, :len(seq) - 1] = seq[:-1]
        tgt[i, :len(seq) - 1] = seq[1:]
    return TensorDataset(ids, tgt)


class GRULM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32, padding_idx=PAD)
        self.gru = nn.GRU(32, 48, batch_first=True)
        self.out = nn.Linear(48, VOCAB)

    def forward(self, ids):
        return self.out(self.gru(self.emb(ids))[0])


@torch.no_grad()
def validate(rt, model, loader):
    model.eval()
    total, tokens = 0.0, 0
    for ids, tgt in loader:
        ids, tgt = rt.to_device(ids, tgt)
        logits = model(ids)
        total += F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100,
                                 reduction="sum").item()
        tokens += int((tgt != -100).sum())
    model.train()
    val_loss = rt.mean(total / tokens)
    return val_loss


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = train_chunks(384, 0), val_sentences(48, 1)
    model = rt.wrap(GRULM())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = rt.loader(train_set, batch_size=BATCH)
    val_loader = rt.loader(val_set, batch_size=16, shuffle=False)

    best, bad_epochs = float("inf"), 0
    for epoch in range(1, EPOCHS + 1):
        for ids, tgt in loader:
            ids, tgt = rt.to_device(ids, tgt)
            loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_loss = validate(rt, model, val_loader)
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val_loss:.6f} "
                  f"ppl {math.exp(val_loss):.4f}")
        if val_loss < best - 1e-3:
            best, bad_epochs = val_loss, 0
        else:
            bad_epochs += 1
            if bad_epochs > PATIENCE:
                rt.print0(f"early stop at epoch {epoch}")
                break
    rt.print0(f"best val_loss {best:.6f}")


if __name__ == "__main__":
    main()
