"""The same tiny GPT made data-parallel with ddpkit, its loop kept: diff it against
examples/gpt_plain.py. The checkpointer resumes it exactly, at any iteration.

    ddpkit run --nproc 2 examples/gpt_ddpkit.py --max_iters=100           # 2 processes
    python examples/gpt_ddpkit.py --max_iters=100                         # still runs as 1 process
    ddpkit run --nproc 2 examples/gpt_ddpkit.py --max_iters=200 --init_from=resume
"""
import argparse as corpus  # the text to learn: the bytes of this module's source
import inspect
import math
import os
import sys
import time
from ast import literal_eval
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn import functional as F

import ddpkit

# -----------------------------------------------------------------------------
# default config values
out_dir = 'out-gpt'
eval_interval = 20
log_interval = 10
eval_iters = 8
always_save_checkpoint = True  # if True, always save a checkpoint after each eval
init_from = 'scratch'  # 'scratch' or 'resume'
gradient_accumulation_steps = 4  # used to simulate larger batch sizes
batch_size = 8  # micro-batch size
block_size = 32
n_layer, n_head, n_embd, dropout = 2, 2, 32, 0.1
learning_rate = 3e-3  # max learning rate
max_iters = 60  # total number of training iterations
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0  # clip gradients at this value, or disable if == 0.0
decay_lr = True  # whether to decay the learning rate
warmup_iters = 10  # how many steps to warm up for
lr_decay_iters = 60  # should be ~= max_iters per Chinchilla
min_lr = 3e-4  # minimum learning rate, should be ~= learning_rate/10 per Chinchilla
# --key=value on the command line overrides them (nanoGPT's configurator.py, without the exec)
for arg in sys.argv[1:]:
    key, val = arg.removeprefix('--').split('=', 1)
    assert key in globals(), f"unknown config key: {key}"
    try:
        globals()[key] = literal_eval(val)
    except (SyntaxError, ValueError):
        globals()[key] = val  # a string
# -----------------------------------------------------------------------------

rt = ddpkit.setup()  # 1: join the job (torchrun, ddpkit run, srun, or one plain process)
ddp = rt.world_size > 1
# the same global batch and number of evaluated windows at any world size, as nanoGPT does
assert gradient_accumulation_steps % rt.world_size == 0 and eval_iters % rt.world_size == 0
gradient_accumulation_steps //= rt.world_size
eval_iters //= rt.world_size
os.makedirs(out_dir, exist_ok=True)
# 2: each rank draws its own random windows (nanoGPT's seed_offset), the same sampling as on one
# process; a sampler over fixed windows would change what is trained on. The checkpointer saves
# every rank's RNG, so a resumed run draws the very windows the uninterrupted one does.
torch.manual_seed(1337 + rt.rank)
device = str(rt.device)
device_type = 'cuda' if 'cuda' in device else 'cpu'  # for later use in torch.autocast
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float16'
ptdtype = {'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' else torch.autocast(device_type=device_type, dtype=ptdtype)

# byte-level "dataset": no download, no tokenizer; 90% train, 10% val
data = torch.tensor(list(inspect.getsource(corpus).encode()), dtype=torch.long)
train_data, val_data = data[:int(0.9 * len(data))], data[int(0.9 * len(data)):]


def get_batch(split):
    data = train_data if split == 'train' else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    if device_type == 'cuda':  # pin arrays x,y, which allows us to move them to GPU asynchronously
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0,
                                           is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, 256, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


iter_num = 0
best_val_loss = 1e9
model = rt.wrap(GPT())  # 3: on this rank's device, in DDP (rank 0's weights) on several ranks
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16' and device_type == 'cuda'))
decay = [p for p in model.parameters() if p.dim() >= 2]  # weight decay on matrices only
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': weight_decay},
                               {'params': no_decay, 'weight_decay': 0.0}],
                              lr=learning_rate, betas=(beta1, beta2))
# 4: the whole run (model, optimizer, scaler, every rank's RNG, best_val_loss) is saved at the end
# of the step before each eval, so a resume runs that eval again with the same RNG: exact
ckpt = rt.checkpointer(os.path.join(out_dir, 'run'), model=model, optimizer=optimizer,
                       scaler=scaler, every_steps=eval_interval,
                       extra={'best_val_loss': best_val_loss},
                       resume='auto' if init_from == 'resume' else None)
iter_num, best_val_loss = ckpt.global_step, ckpt.extra['best_val_loss']


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = rt.mean(losses)  # 5: over every rank's windows, the same on every rank
    model.train()
    return out


def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


# training loop
t0 = time.time()
while True:
    # determine and set the learning rate for this iteration
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    # evaluate the loss on train/val sets and write checkpoints
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        rt.print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                  f"over {eval_iters * batch_size * rt.world_size} windows")
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = ckpt.extra['best_val_loss'] = losses['val']
            if iter_num > 0 and rt.is_main:  # the weights for sampling; the run itself is in ckpt
                checkpoint = {
                    'model': rt.unwrap(model).state_dict(),
                    'iter_num': iter_num,
                    'best_val_loss': best_val_loss,
                }
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))

    # forward backward update, with optional gradient accumulation to simulate larger batch size
    for micro_step in range(gradient_accumulation_steps):
        # drawn here, not prefetched: no batch is in flight when a step ends (and may be saved)
        X, Y = get_batch('train')
        # 6: all-reduce the gradients on the last micro-step only (nanoGPT sets DDP's private
        # require_backward_grad_sync; no_sync is the public way, forward and backward inside it)
        last = micro_step == gradient_accumulation_steps - 1
        with model.no_sync() if ddp and not last else nullcontext():
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
            # backward pass, with gradient scaling if training in fp16
            scaler.scale(loss).backward()
    # clip the gradient
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    # step the optimizer and scaler if training in fp16
    scaler.step(optimizer)
    scaler.update()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)

    # timing and logging
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0:
        lossf = rt.mean(loss) * gradient_accumulation_steps  # the last micro-step's, over ranks
        rt.print0(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    ckpt.step()  # 7: counts iter_num, saves when due; on SIGTERM saves, then exits 143

    # termination conditions
    if iter_num > max_iters:
        break

ckpt.close()  # a stop signal during the last iterations still saves
if rt.is_main:
    torch.save(rt.unwrap(model).state_dict(), os.path.join(out_dir, 'final.pt'))
