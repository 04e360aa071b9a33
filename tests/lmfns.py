"""Rank functions for test_batches.py: a tiny language model, evaluated and trained on N ranks."""
import torch
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.training.loop import fit

VOCAB, T = 11, 6


class TinyLM(nn.Module):
    """Logits (B, T, V) from token ids (B, T)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class Output:
    """What a Hugging Face causal LM returns: .logits, and .loss with labels shifted inside."""

    def __init__(self, logits, loss):
        self.logits, self.loss = logits, loss


class HFStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = TinyLM()

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.lm(input_ids)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                               labels[:, 1:].reshape(-1), ignore_index=-100)
        return Output(logits, loss)


def tokens(n, seed=0, pad_every=0):
    """n sequences (x, y): y is x shifted by one; every pad_every-th target is padding (-100)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (n, T + 1), generator=g)
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
    if pad_every:
        y.view(-1)[::pad_every] = -100
    return torch.utils.data.TensorDataset(x, y)


class DictTokens(Dataset):
    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, T), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def lm_eval(n, batch_size, pad_every):
    rt = ddpkit.setup()
    torch.manual_seed(0)
    model = rt.wrap(TinyLM())
    return rt.evaluate(model, tokens(n, pad_every=pad_every), batch_size=batch_size, topk=(1, 3))


def hf_eval(n, batch_size):
    rt = ddpkit.setup()
    torch.manual_seed(0)
    model = rt.wrap(HFStyle())
    return rt.evaluate(model, DictTokens(n), batch_size=batch_size, topk=(1,))


def hf_fit(n, global_batch, epochs):
    """Train the HF-style model on dict batches (its own .loss), evaluate exactly, log the mean."""
    rt = ddpkit.setup(seed=0)
    torch.manual_seed(0)
    model = rt.wrap(HFStyle())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    state = fit(rt, model, opt, rt.loader(DictTokens(n), batch_size=global_batch, shuffle=False),
                epochs=epochs, eval_data=DictTokens(n, seed=1), eval_topk=(1,), progress=False)
    params = [p.detach().clone() for p in rt.unwrap(model).parameters()]
    return {"history": state.history, "params": params,
            "mean": rt.mean(torch.tensor(float(rt.rank)))}
