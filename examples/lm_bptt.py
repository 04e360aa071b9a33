"""A recurrent language model fed as PyTorch's word_language_model feeds it: one long token tensor
laid out in columns and read in BPTT slices, no Dataset, the hidden state carried from slice to
slice; data-parallel with ddpkit and resumable exactly, mid-epoch included.

    ddpkit run --nproc 2 examples/lm_bptt.py --epochs 2
    python examples/lm_bptt.py --epochs 2               # 1 process: the same columns, all of them

How it maps (docs/checkpoints.md, "Data that is not a Dataset"): ``rt.slices`` splits the
columns over the ranks (each rank its own adjacent columns, so 2 ranks read together what 1
reads); the checkpointer takes it as ``loader=`` and keeps its place (epoch, row); the hidden
state differs between ranks, so it is kept per rank in ``extra=``.
"""
import argparse
import inspect
import math

import torch
from torch import nn

import ddpkit


def make_tokens():
    """Bytes of the standard library's argparse source: text every Python has (90 % / 10 %)."""
    import argparse as corpus
    raw = torch.tensor(list(inspect.getsource(corpus).encode()), dtype=torch.long)
    split = int(0.9 * len(raw))
    return raw[:split], raw[split:]


class RNNModel(nn.Module):
    def __init__(self, vocab=256, dim=64, layers=2, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, layers, dropout=dropout)
        self.decoder = nn.Linear(dim, vocab)
        self.layers, self.dim = layers, dim

    def forward(self, ids, hidden):                      # ids: (bptt, columns)
        out, hidden = self.rnn(self.drop(self.encoder(ids)), hidden)
        return self.decoder(self.drop(out)), hidden

    def init_hidden(self, columns, device):
        zeros = torch.zeros(self.layers, columns, self.dim, device=device)
        return [zeros, zeros.clone()]


def evaluate(rt, model, tokens, columns, bptt):
    """Mean loss per token over every rank's columns: sums and counts reduced, not means."""
    model.eval()
    data = rt.slices(tokens, batch_size=columns, bptt=bptt)
    hidden, total, count = rt.unwrap(model).init_hidden(data.batch_size, rt.device), 0.0, 0
    with torch.no_grad():
        for x, y in data:
            x, y = rt.to_device(x, y)
            out, hidden = rt.unwrap(model)(x, hidden)
            total += nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(),
                                                 reduction="sum").item()
            count += y.numel()
    model.train()
    return rt.reduce(torch.tensor(total), "sum").item() / rt.reduce(torch.tensor(count), "sum").item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--columns", type=int, default=16, help="global batch: streams read at once")
    p.add_argument("--bptt", type=int, default=32)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps too")
    p.add_argument("--out", default="runs/lm_bptt")
    args = p.parse_args()

    rt = ddpkit.setup(seed=0)
    train_tokens, val_tokens = make_tokens()
    model = rt.wrap(RNNModel())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    train = rt.slices(train_tokens, batch_size=args.columns, bptt=args.bptt)
    def fresh():
        return rt.unwrap(model).init_hidden(train.batch_size, rt.device)

    ckpt = rt.checkpointer(f"{args.out}/ckpt", model=model, optimizer=opt, loader=train,
                           every_steps=args.every, extra={"hidden": fresh(), "evals": []})
    for epoch in range(ckpt.epoch, args.epochs):
        # a new epoch starts its streams afresh; a resume mid-epoch carries the saved state on
        hidden = ckpt.extra["hidden"] if ckpt.mid_epoch else fresh()
        for x, y in train:
            x, y = rt.to_device(x, y)
            hidden = [h.detach() for h in hidden]        # truncated backpropagation
            out, hidden = model(x, hidden)
            loss = nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            ckpt.extra["hidden"] = [h.detach() for h in hidden]   # this rank's, saved per rank
            ckpt.step()
            if args.eval_every and ckpt.global_step % args.eval_every == 0:
                ckpt.extra["evals"].append(evaluate(rt, model, val_tokens, args.columns, args.bptt))
        val = evaluate(rt, model, val_tokens, args.columns, args.bptt)
        rt.print0(f"epoch {epoch}: train loss {rt.mean(loss):.4f}, validation loss {val:.4f} "
                  f"(perplexity {math.exp(val):.2f})")
    ckpt.close()
    if rt.is_main:
        torch.save({"model": rt.unwrap(model).state_dict(), "step": ckpt.global_step,
                    "evals": ckpt.extra["evals"], "val": val}, f"{args.out}/final.pt")
    rt.shutdown()


if __name__ == "__main__":
    main()
