"""The ``horovod`` row of ``ddpkit bench``: the same timed steps under Horovod over gloo.

Only imported when ``horovod.torch`` imports; ``horovod.runner.run`` starts fresh processes.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["launch_horovod", "horovod_row"]


def horovod_row(job: Dict[str, Any]) -> Dict[str, Any]:
    """One rank: hvd.init, DistributedOptimizer, broadcast of weights and state, timed steps.

    Example::

        horovod.runner.run(horovod_row, args=(job,), np=2, use_gloo=True)
    """
    import horovod.torch as hvd

    from .bench_worker import _peak_mb, optimizer_state_bytes
    from .datasets import synthetic
    from .models import build_model

    hvd.init()
    torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])
    model = build_model(job["model"], 100, 3)
    opt = torch.optim.SGD(model.parameters(), lr=job["lr"], momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    data = synthetic(job["epoch_size"], shape=(3, 32, 32), num_classes=100, seed=job["seed"])
    sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), drop_last=True)
    batches = iter(DataLoader(data, batch_size=job["batch"], sampler=sampler, drop_last=True))
    times: List[float] = []
    for i in range(job["warmup"] + job["steps"]):
        start = time.perf_counter()
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # waits for Horovod's all-reduce of every gradient
        if i >= job["warmup"]:
            times.append(time.perf_counter() - start)
    return {"rank": hvd.rank(), "step_s": times, "peak_mb": _peak_mb(torch.device("cpu")),
            "opt_state_mb": optimizer_state_bytes(opt) / 2**20,
            "threads": torch.get_num_threads(), "steps_total": job["warmup"] + job["steps"]}


def launch_horovod(plan: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Run :func:`horovod_row` on ``plan['nprocs']`` local processes (gloo controller).

    Example::

        launch_horovod(plan_row(ROWS["horovod"], cfg, caps), timeout=600)
    """
    from horovod.runner import run

    ranks = run(horovod_row, args=(plan["job"],), np=plan["nprocs"], use_gloo=True,
                start_timeout=int(timeout))
    return {"ranks": sorted(ranks, key=lambda r: r["rank"]), "backend": "horovod-gloo"}
