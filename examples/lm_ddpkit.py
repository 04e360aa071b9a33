"""The same language model made data-parallel with ddpkit: diff it against examples/lm_plain.py.

    ddpkit run --nproc 2 examples/lm_ddpkit.py --epochs 2     # 2 processes
    python examples/lm_ddpkit.py --epochs 2                   # still runs as 1 process
"""
import argparse
import inspect
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def make_data(context: int = 64):
    """Byte windows of the standard library's argparse source: text every Python has."""
    import argparse as corpus
    raw = torch.tensor(list(inspect.getsource(corpus).encode()), dtype=torch.long)
    n = (len(raw) - 1) // context
    x = raw[: n * context].view(n, context)
    y = raw[1: n * context + 1].view(n, context)
    split = int(0.9 * n)
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


class CharLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, context: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        return self.head(self.body(x, mask=mask, is_causal=True))   # (batch, time, vocab)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="lm.pt")
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)                                        # 1: join the job
    train_set, val_set = make_data()
    model = rt.wrap(CharLM())                                        # 2: DDP on this rank's device
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = rt.loader(train_set, batch_size=args.batch_size)       # 3: global batch, set_epoch owned

    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = rt.to_device(x, y)                                # 4: this rank's device
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        rt.print0(f"epoch {epoch}: last loss {rt.mean(loss):.4f}")  # 5: the mean over ranks

    result = rt.evaluate(model, val_set, per_rank_batch=64, topk=())   # 6: exact, per token
    rt.print0(f"validation loss {result['loss']:.4f}, perplexity {math.exp(result['loss']):.2f} "
              f"over {result['count']} tokens")
    if rt.is_main:
        torch.save(rt.unwrap(model).state_dict(), args.out)


if __name__ == "__main__":
    main()
