"""GRU text classifier (synthetic token sequences), accumulation over 2 micro-batches,
Adam, LR halved every epoch.

    python train.py
    ddpkit run --nproc 2 train.py
"""
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

VOCAB, SEQ, CLASSES = 50, 16, 3
EPOCHS, BATCH, ACCUM = 3, 64, 2


def make_corpus(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    tokens = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    keyword_pos = torch.randint(0, SEQ, (n, 2), generator=g)
    for i in range(n):
        tokens[i, keyword_pos[i]] = y[i]
    return TensorDataset(tokens, y)


class GRUClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.gru = nn.GRU(32, 48, batch_first=True)
        self.fc = nn.Linear(48, CLASSES)

    def forward(self, tokens):
        out, _ = self.gru(self.emb(tokens))
        return self.fc(out.mean(1))


def main():
    rt = ddpkit.setup(seed=0)
    ddp = rt.world_size > 1
    train_set, val_set = make_corpus(512, 0), make_corpus(128, 1)
    model = rt.wrap(GRUClassifier())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    loader = rt.loader(train_set, batch_size=BATCH, accum_steps=ACCUM)

    for epoch in range(1, EPOCHS + 1):
        for i, (tokens, y) in enumerate(loader):
            tokens, y = rt.to_device(tokens, y)
            last = (i + 1) % ACCUM == 0
            with model.no_sync() if ddp and not last else nullcontext():
                loss = nn.functional.cross_entropy(model(tokens), y) / ACCUM
                loss.backward()
            if last:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        val = rt.evaluate(model, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss) * ACCUM:.6f} val_loss {val['loss']:.6f} "
                  f"acc {val['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
