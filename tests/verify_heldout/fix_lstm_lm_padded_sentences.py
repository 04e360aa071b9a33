"""Word-level LSTM language model on variable-length sentences (padded to the longest,
padding ignored in the loss), AdamW, perplexity on a held-out set after each epoch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

VOCAB, MAX_LEN, PAD, BOS = 40, 24, 0, 1
EPOCHS, BATCH = 3, 32


def make_sentences(n, seed):
    """Arithmetic progressions mod 38 of random length (4..23 tokens), after a BOS token."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.full((n, MAX_LEN), PAD)
    targets = torch.full((n, MAX_LEN), -100)
    lengths = torch.randint(4, MAX_LEN, (n,), generator=g)
    for i in range(n):
        start, step = torch.randint(0, 38, (2,), generator=g).tolist()
        seq = [BOS] + [2 + (start + k * (1 + step % 5)) % 38 for k in range(int(lengths[i]))]
        seq = torch.tensor(seq)
        inputs[i, :len(seq) - 1] = seq[:-1]
        targets[i, :len(seq) - 1] = seq[1:]
    return TensorDataset(inputs, targets)


class LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32, padding_idx=PAD)
        self.lstm = nn.LSTM(32, 48, num_layers=2, batch_first=True, dropout=0.0)
        self.out = nn.Linear(48, VOCAB)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids))
        return self.out(h)


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_sentences(384, 0), make_sentences(128, 1)
    model = rt.wrap(LSTMLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-3)
    loader = rt.loader(train_set, batch_size=BATCH)

    for epoch in range(1, EPOCHS + 1):
        for ids, targets in loader:
            ids, targets = rt.to_device(ids, targets)
            logits = model(ids)
            n_tokens = rt.reduce((targets != -100).sum(), "sum") / rt.world_size
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                   reduction="sum") / n_tokens
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        val = rt.evaluate(model, val_set, batch_size=64, topk=())
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"ppl {math.exp(val['loss']):.4f} tokens {val['count']}")


if __name__ == "__main__":
    main()
