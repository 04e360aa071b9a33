"""Functions run on every rank by ddpkit.launch in the multi-process tests (must be importable)."""
import os

import torch
from torch import nn

import ddpkit
from ddpkit import comm


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
