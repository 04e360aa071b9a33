"""Functions run on every rank by ddpkit.launch in the multi-process tests (must be importable)."""
import os

import torch
from torch import nn

import ddpkit
from ddpkit.engines import comm


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def full_batch(n: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def ddp_one_step():
    """Gradients after one DDP step on this rank's slice, and the updated parameters."""
    rt = ddpkit.setup()
    model = rt.wrap(tiny_model())
    x, y = full_batch()
    per = x.shape[0] // rt.world_size
    sl = slice(rt.rank * per, (rt.rank + 1) * per)
    nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
    grads = [p.grad.clone() for p in rt.unwrap(model).parameters()]
    every_rank = comm.gather_object(grads)
    return {"grads": grads, "all_equal": all(
        all(torch.equal(a, b) for a, b in zip(grads, other)) for other in every_rank)}


def comm_ops(marker_dir: str):
    rt = ddpkit.setup()
    r, n = rt.rank, rt.world_size
    out = {
        "sum_int": comm.reduce(r + 1),
        "mean_float": comm.reduce(float(r), "mean"),
        "max_tensor": comm.reduce(torch.tensor([r, -r], dtype=torch.float32), "max").tolist(),
        "min_num": comm.reduce(r * 2.5, "min"),
        "bf16_sum": comm.reduce(torch.ones(2, dtype=torch.bfloat16), "sum").tolist(),
        "gathered": comm.gather_object(list(range(r + 1))),
        "broadcast": comm.broadcast_object(f"from {r}"),
        "world": (comm.rank(), comm.world_size(), comm.is_main()),
    }
    with comm.main_process_first():
        # Rank 0 runs first: when other ranks enter, its marker must exist already.
        seen = sorted(os.listdir(marker_dir))
        open(os.path.join(marker_dir, f"rank{r}"), "w").close()
    out["first_seen"] = comm.gather_object(seen)
    comm.barrier()
    assert n == len(out["gathered"])
    return out


def loader_epochs(n_samples: int, global_batch: int, epochs: int, seed: int):
    """Indices each rank saw per epoch, plus a mid-epoch resume of epoch 1."""
    rt = ddpkit.setup()
    data = torch.utils.data.TensorDataset(torch.arange(n_samples))
    loader = rt.loader(data, batch_size=global_batch, seed=seed)
    seen = [[int(i) for (b,) in loader for i in b] for _ in range(epochs)]
    resumed = rt.loader(data, batch_size=global_batch, seed=seed)
    resumed.load_state_dict({"epoch": 1, "samples_done": global_batch, "seed": seed})
    tail = [int(i) for (b,) in resumed for i in b]
    after = [int(i) for (b,) in resumed for i in b]   # next pass is epoch 2
    return comm.gather_object({"epochs": seen, "tail": tail, "after": after,
                               "len": len(loader)})


def exact_eval(n_samples: int, batch_size: int):
    rt = ddpkit.setup()
    torch.manual_seed(0)
    model = rt.wrap(tiny_model())
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(n_samples, 8, generator=g),
                                          torch.randint(0, 3, (n_samples,), generator=g))
    return rt.evaluate(model, data, batch_size=batch_size, topk=(1, 2))


def raise_on_rank(bad_rank: int):
    rt = ddpkit.setup()
    if rt.rank == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    rt.barrier()  # the healthy ranks wait here: the launcher must stop them, not hang
    return "unreachable"


def _counting_allreduce(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    state["calls"] += 1
    return allreduce_hook(None, bucket)


def accumulate_run(accum: int, opt_steps: int, micro: int, use_no_sync: bool = True):
    """Parameters after `opt_steps` optimizer steps of `accum` micro-steps, and all-reduce count."""
    from ddpkit.training.accumulate import Accumulator

    rt = ddpkit.setup()
    model = rt.wrap(tiny_model(), bucket_cap_mb=1024)
    counter = {"calls": 0}
    model.register_comm_hook(counter, _counting_allreduce)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, steps=accum)
    if not use_no_sync:
        acc.model = rt.unwrap(model)  # the naive way: DDP syncs on every backward
    n = rt.world_size
    x, y = full_batch(n * accum * micro * opt_steps, seed=5)
    for step in range(opt_steps):
        for k in range(accum):
            block = (step * accum + k) * n + rt.rank
            sl = slice(block * micro, (block + 1) * micro)
            with acc.micro_step():
                acc.backward(nn.functional.cross_entropy(model(x[sl]), y[sl]))
    return {"params": [p.detach().clone() for p in rt.unwrap(model).parameters()],
            "allreduce_calls": counter["calls"], "optimizer_steps": acc.optimizer_steps}


def sync_bn_on_cpu():
    rt = ddpkit.setup()
    try:
        rt.wrap(nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6)), sync_bn=True)
    except ddpkit.ConfigError as exc:
        return str(exc)
    return None


def fit_run(epochs: int, global_batch: int, seed: int = 0):
    """Train the tiny model with ddpkit.fit; final parameters and history (same on any world size)."""
    from ddpkit.training.loop import fit

    rt = ddpkit.setup(seed=seed)
    x, y = full_batch(203, seed=11)  # odd size: the last batch is partial
    data = torch.utils.data.TensorDataset(x, y)
    model = rt.wrap(tiny_model(seed))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loader = rt.loader(data, batch_size=global_batch, seed=seed, drop_last=True)
    state = fit(rt, model, opt, loader, epochs=epochs, eval_data=data, progress=False)
    return {"params": [p.detach().clone() for p in rt.unwrap(model).parameters()],
            "history": state.history, "steps": state.step}


def one_rank_skips_the_barrier(timeout_s: float):
    """Rank 1 never reaches the barrier: rank 0 must fail after the collective timeout, not hang."""
    import time
    from datetime import timedelta

    rt = ddpkit.setup(timeout=timedelta(seconds=timeout_s))
    if rt.rank == 1:
        time.sleep(60)
        return None
    rt.barrier()
    return "barrier passed"


def hook_one_step(hook: str):
    """Averaged gradients after one DDP step with ``comm_hook=hook`` on gloo."""
    rt = ddpkit.setup()
    model = rt.wrap(tiny_model(), comm_hook=hook)
    x, y = full_batch()
    per = x.shape[0] // rt.world_size
    sl = slice(rt.rank * per, (rt.rank + 1) * per)
    nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
    return [p.grad.clone() for p in rt.unwrap(model).parameters()]


class _LossSeen(ddpkit.Hook):
    def __init__(self):
        self.seen = []

    def on_step_end(self, loop, metrics):
        self.seen.append(metrics["train/loss"])


def fit_reported_loss(accum: int, hooks_on_rank0_only: bool = False):
    """What a Hook and the metrics log receive as train/loss, beside every micro-batch's local
    (loss, samples) on this rank: an uneven dataset (the last batch is smaller on one rank)."""
    rt = ddpkit.setup(seed=0)
    model = rt.wrap(tiny_model())
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(22, 8, generator=g),
                                          torch.randint(0, 3, (22,), generator=g))
    local = []

    def loss_fn(logits, y):
        loss = nn.functional.cross_entropy(logits, y)
        local.append((float(loss), len(y)))
        return loss

    hook = _LossSeen()
    hooks = [hook] if rt.is_main or not hooks_on_rank0_only else []  # a logger on rank 0, say
    ddpkit.fit(
        rt, model, torch.optim.SGD(model.parameters(), lr=0.1), rt.loader(data, 8, shuffle=False),
        epochs=1, loss_fn=loss_fn, accum_steps=accum, hooks=hooks, progress=False)
    return {"seen": comm.gather_object(hook.seen), "local": comm.gather_object(local)}


class _Bucket:
    """A gradient bucket as a DDP comm hook sees it (buffer, index, is_last)."""

    def __init__(self, buffer, index=0, last=True):
        self._buffer, self._index, self._last = buffer, index, last

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def batched_powersgd_steps(rank: int, start: int, steps: int, numels, dtype: str = "float32"):
    """Each step: this rank's random gradients (one bucket per entry of ``numels``) through
    ddpkit's batched PowerSGD hook, one bucket after another as DDP hands them; per bucket what
    came back, the exact average and every rank's gradients, and at the end the ranks' mean
    error (error feedback's memory)."""
    from ddpkit.cost.lowrank import BatchedPowerSGD, batched_powersgd_hook

    rt = ddpkit.setup()
    state = BatchedPowerSGD(rank=rank, start_powerSGD_iter=start)
    g = torch.Generator().manual_seed(100 + rt.rank)
    kind = getattr(torch, dtype)
    out = {"applied": [], "exact": [], "grads": []}
    for _ in range(steps):
        grads = [(torch.randn(n, generator=g) * torch.linspace(0.1, 3, n)).to(kind)
                 for n in numels]
        out["exact"].append([comm.reduce(x.float(), "mean") for x in grads])
        out["grads"].append(comm.gather_object(grads))
        futures = [batched_powersgd_hook(state, _Bucket(x.clone(), i, i == len(numels) - 1))
                   for i, x in enumerate(grads)]
        out["applied"].append([f.wait().clone() for f in futures])
    out["error"] = [comm.reduce(state.error[i][:n].clone(), "mean") if i in state.error
                    else None for i, n in enumerate(numels)]
    every = comm.gather_object(out["applied"])
    out["same"] = all(all(torch.equal(a, b) for step, other in zip(out["applied"], o)
                          for a, b in zip(step, other)) for o in every)
    return out


def train_with_hook(hook, steps: int, bucket_cap_mb: float = 25.0):
    """``steps`` of a user's own loop with ``comm_hook=hook`` (compressing from step 2): the
    full-batch loss before and after, and whether the ranks' parameters agree."""
    rt = ddpkit.setup(seed=0)
    model = rt.wrap(tiny_model(), comm_hook=hook, powersgd_start_iter=2,
                    bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x, y = full_batch(96)
    per = x.shape[0] // rt.world_size
    sl = slice(rt.rank * per, (rt.rank + 1) * per)
    with torch.no_grad():
        before = nn.functional.cross_entropy(model(x), y).item()
    for _ in range(steps):
        nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        after = nn.functional.cross_entropy(model(x), y).item()
    params = [p.detach().clone() for p in rt.unwrap(model).parameters()]
    every = comm.gather_object(params)
    return {"before": before, "after": after,
            "same": all(all(torch.equal(a, b) for a, b in zip(params, o)) for o in every)}
