"""EXPECT: pass
A correct causal language model on nn.TransformerEncoderLayer (default dropout=0.1, which also
drops attention weights inside nn.MultiheadAttention) over token windows from rt.loader, with a
causal mask and per-token cross-entropy over equal-length sequences: 2 processes compute the same
as 1 (dropout masks may differ per rank; that is legitimate randomness, not a bug).
"""
import argparse
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit


def markov_corpus(n_tokens=20000, vocab=48, seed=0):
    """Tokens from a fixed sparse random Markov chain: learnable, no download."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    probs = torch.softmax(logits, dim=1)
    out = torch.empty(n_tokens, dtype=torch.long)
    out[0] = 0
    choices = torch.multinomial(probs, n_tokens, replacement=True, generator=g)  # (vocab, n)
    for i in range(1, n_tokens):
        out[i] = choices[out[i - 1], i]
    return out


def windows(tokens, context):
    n = (len(tokens) - 1) // context
    x = tokens[: n * context].view(n, context)
    y = tokens[1: n * context + 1].view(n, context)
    return x, y


class TinyLM(nn.Module):
    def __init__(self, vocab, dim=48, heads=4, layers=2, context=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, context, dim))
        layer = nn.TransformerEncoderLayer(d_model=dim, nhead=heads, dim_feedforward=2 * dim,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers,
                                             enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, idx):
        t = idx.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        h = self.embed(idx) + self.pos[:, :t]
        h = self.encoder(h, mask=causal, is_causal=True)
        return self.lm_head(self.norm(h))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    vocab = 48
    x, y = windows(markov_corpus(vocab=vocab), args.context)
    split = 512                                   # 16 steps of 32 windows
    train_set = TensorDataset(x[:split], y[:split])
    val_set = TensorDataset(x[split:], y[split:])

    model = rt.wrap(TinyLM(vocab, context=args.context))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                  weight_decay=0.05)
    loader = rt.loader(train_set, batch_size=args.batch_size)

    for epoch in range(args.epochs):
        model.train()
        for step, (xb, yb) in enumerate(loader):
            xb, yb = rt.to_device(xb, yb)
            logits = model(xb)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), yb.view(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % 4 == 0:
                rt.print0(f"epoch {epoch} step {step}: loss {rt.mean(loss):.4f}")
        result = rt.evaluate(model, val_set, batch_size=64, topk=())
        rt.print0(f"epoch {epoch}: val loss {result['loss']:.4f} "
                  f"ppl {math.exp(result['loss']):.2f} over {result['count']} tokens")


if __name__ == "__main__":
    main()
