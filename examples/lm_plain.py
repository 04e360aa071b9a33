"""A plain single-process character-level language model: diff it against examples/lm_ddpkit.py.

    python examples/lm_plain.py --epochs 2
"""
import argparse
import inspect
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, val_set = make_data()
    model = CharLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)

    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: last loss {loss.item():.4f}")

    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in DataLoader(val_set, batch_size=64):
            x, y = x.to(device), y.to(device)
            logits = model(x).flatten(0, 1)
            total += nn.functional.cross_entropy(logits, y.flatten(), reduction="sum").item()
            tokens += y.numel()
    print(f"validation loss {total / tokens:.4f}, perplexity {math.exp(total / tokens):.2f} "
          f"over {tokens} tokens")
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
