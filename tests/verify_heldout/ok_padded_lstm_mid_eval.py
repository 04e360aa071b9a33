"""Variable-length sequence classifier: packed 2-layer LSTM over padded token sequences,
SGD + StepLR per epoch, clipping, a validation pass every 6 steps in the middle of training.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import TensorDataset

import ddpkit

VOCAB, MAX_LEN, PAD = 30, 20, 0
EPOCHS, BATCH, EVAL_EVERY = 3, 32, 6


def make_reviews(n, seed):
    """Label = whether 'positive' tokens (2..5) outnumber 'negative' ones (6..9)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, MAX_LEN + 1, (n,), generator=g)
    tokens = torch.randint(2, VOCAB, (n, MAX_LEN), generator=g)
    mask = torch.arange(MAX_LEN)[None, :] < lengths[:, None]
    tokens = torch.where(mask, tokens, torch.full_like(tokens, PAD))
    pos = ((tokens >= 2) & (tokens <= 5)).sum(1)
    neg = ((tokens >= 6) & (tokens <= 9)).sum(1)
    return TensorDataset(tokens, lengths, (pos >= neg).long())


class Reviews(torch.utils.data.Dataset):
    def __init__(self, tensors):
        self.tokens, self.lengths, self.labels = tensors.tensors

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return (self.tokens[i], self.lengths[i]), self.labels[i]


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24, padding_idx=PAD)
        self.lstm = nn.LSTM(24, 32, num_layers=2, batch_first=True, dropout=0.0)
        self.fc = nn.Linear(32, 2)

    def forward(self, inputs):
        tokens, lengths = inputs
        packed = pack_padded_sequence(self.emb(tokens), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.fc(h[-1])


def main():
    rt = ddpkit.setup(seed=0)
    train_set = Reviews(make_reviews(384, 0))
    val_set = Reviews(make_reviews(160, 1))
    model = rt.wrap(PackedLSTM())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = rt.loader(train_set, batch_size=BATCH)

    step = 0
    for epoch in range(1, EPOCHS + 1):
        model.train()
        for inputs, y in loader:
            inputs, y = rt.to_device(inputs, y)
            loss = F.cross_entropy(model(inputs), y)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if step % EVAL_EVERY == 0:
                val = rt.evaluate(model, val_set, topk=(1,))
                rt.print0(f"step {step} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f}")
        scheduler.step()
        val = rt.evaluate(model, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"acc {val['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
