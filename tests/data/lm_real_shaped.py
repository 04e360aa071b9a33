"""A language model as real scripts write one (after pytorch/examples' word_language_model):
batchified bytes of a file read by a relative path, time-major BPTT chunks, nn.LSTM with its own
dropout, an average of weights kept with copy.deepcopy, checkpoints in a relative directory that
it resumes from on its own, and the whole model pickled with torch.save at the end.

    ddpkit run --nproc 2 tests/data/lm_real_shaped.py           # from the repository's root
    ddpkit verify --steps 4 tests/data/lm_real_shaped.py
    ... --ask                       # first asks a question on standard input
    ... --pids DIR --hang           # writes its pid into DIR, then never steps (kill tests)
"""
import argparse
import copy
import os
import time

import torch
from torch import nn

import ddpkit

BPTT, BATCH = 16, 8


class LM(nn.Module):
    def __init__(self, vocab=256, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=2, dropout=0.2)   # time-major
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


class Chunks(torch.utils.data.Dataset):
    """BPTT windows of a corpus: (input, target), each BPTT bytes long."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return (len(self.data) - 1) // BPTT

    def __getitem__(self, i):
        s = i * BPTT
        return self.data[s:s + BPTT], self.data[s + 1:s + 1 + BPTT]


def time_major(batch):
    x, y = zip(*batch)
    return torch.stack(x, 1), torch.stack(y, 1)   # (BPTT, batch)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="pyproject.toml")
    p.add_argument("--save", default="model.pt")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ask", action="store_true")
    p.add_argument("--pids", default=None)
    p.add_argument("--hang", action="store_true")
    args = p.parse_args()
    if args.ask and input("overwrite the last run? [y/N] ") != "y":
        return
    rt = ddpkit.setup(seed=0)
    if args.pids:
        open(os.path.join(args.pids, f"{os.getpid()}.pid"), "w").close()
    with open(args.data, "rb") as f:
        data = torch.tensor(list(f.read()[:4096]), dtype=torch.long)
    model = rt.wrap(LM())
    average = copy.deepcopy(rt.unwrap(model))       # an average of the weights, for evaluation
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = rt.loader(Chunks(data), batch_size=BATCH, collate_fn=time_major)
    ckpt = rt.checkpointer("checkpoints", model=model, optimizer=opt, loader=loader,
                           extra={"average": average})
    while args.hang:
        time.sleep(1)
    for epoch in range(ckpt.epoch, args.epochs):
        model.train()
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for a, w in zip(average.parameters(), rt.unwrap(model).parameters()):
                    a.mul_(0.9).add_(w, alpha=0.1)
            ckpt.step()
        rt.print0(f"epoch {epoch} loss {rt.mean(loss.detach()):.6f}")
    if rt.is_main:
        torch.save(rt.unwrap(model), args.save)     # the whole module, pickled
    ckpt.close()
    rt.shutdown()


if __name__ == "__main__":
    main()
