"""EXPECT: pass
A correct nanoGPT-style model (causal self-attention through
F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
is_causal=True), nn.Dropout on embeddings, residuals and MLP, weight tying) trained on fixed token
windows from rt.loader with AdamW and a warmup-cosine schedule: 2 processes compute the same as
1 (attention dropout differs per rank, which is legitimate randomness, not a bug).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 48
    dropout: float = 0.1
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


# -----------------------------------------------------------------------------
batch_size = 32          # global
block_size = 32
learning_rate = 3e-3
warmup_iters = 4
max_iters = 16
min_lr = 3e-4

rt = ddpkit.setup(seed=0)

# a synthetic "text": repeated noisy arithmetic sequences over 64 symbols
g = torch.Generator().manual_seed(1337)
starts = torch.randint(0, 64, (700,), generator=g)
steps_ = torch.randint(1, 5, (700,), generator=g)
data = ((starts[:, None] + steps_[:, None] * torch.arange(24)[None, :]) % 64).flatten()
noise = torch.rand(len(data), generator=g) < 0.05
data[noise] = torch.randint(0, 64, (int(noise.sum()),), generator=g)
n = (len(data) - 1) // block_size
X = data[: n * block_size].view(n, block_size)
Y = data[1: n * block_size + 1].view(n, block_size)
train_set = TensorDataset(X[:512], Y[:512])
val_set = TensorDataset(X[512:], Y[512:])

model = GPT(GPTConfig(block_size=block_size))
model = rt.wrap(model)
raw_model = rt.unwrap(model)
decay = [p for p in raw_model.parameters() if p.dim() >= 2]
no_decay = [p for p in raw_model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=learning_rate, betas=(0.9, 0.95))
train_loader = rt.loader(train_set, batch_size=batch_size)


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


iter_num = 0
model.train()
while iter_num < max_iters:
    for xb, yb in train_loader:
        if iter_num >= max_iters:
            break
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        xb, yb = rt.to_device(xb, yb)
        logits, loss = model(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if iter_num % 4 == 0:
            rt.print0(f"iter {iter_num}: loss {rt.mean(loss):.4f}, lr {lr:.2e}")
        iter_num += 1



def val_step(model, batch):
    xb, yb = rt.to_device(*batch)
    _, loss = model(xb, yb)
    return {"loss": (loss * yb.numel(), yb.numel())}


metrics = rt.evaluate(model, val_set, batch_size=64, step=val_step)
rt.print0(f"val loss {metrics['loss']:.4f}")
