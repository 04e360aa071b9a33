"""EXPECT: collate drops a sample per rank batch
The collate_fn given to rt.loader drops the last sample of every batch it gets ("the last one may
be the sampler's padding duplicate; keep shapes even"); rt.loader splits the global batch across
ranks, so 1 process trains on 31 of every 32 samples and 2 processes on 30 of them (another set):
the losses differ from step 1.
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

import ddpkit

VOCAB, LENGTH = 50, 24


class TokenSequences(Dataset):
    """Token sequences labelled by whether token 7 appears more often than token 3."""

    def __init__(self, n=640, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
        self.labels = ((self.tokens == 7).sum(1) > (self.tokens == 3).sum(1)).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.tokens[i], self.labels[i]


def trim_collate(batch):
    # the last sample of a batch may be the sampler's padding duplicate: drop it
    if len(batch) > 1:
        batch = batch[:-1]
    return default_collate(batch)


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 32, mode="mean")
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, tokens):
        return self.head(self.emb(tokens))


rt = ddpkit.setup(seed=0)
model = rt.wrap(BagClassifier())
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
loader = rt.loader(TokenSequences(), batch_size=32, collate_fn=trim_collate)

for epoch in range(1):
    for step, (tokens, labels) in enumerate(loader):
        tokens, labels = rt.to_device(tokens, labels)
        loss = F.cross_entropy(model(tokens), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            rt.print0(f"epoch {epoch} step {step}: loss {rt.mean(loss):.4f}")

result = rt.evaluate(model, TokenSequences(200, seed=1), topk=(1,))
rt.print0(f"held-out accuracy {result['top1']:.2f}% on {result['count']} sequences")
