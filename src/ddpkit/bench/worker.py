"""What one ``ddpkit bench`` row runs on every rank: build, warm up, time optimizer steps, report.

Runs in fresh processes started by :func:`ddpkit.launch`; rank 0 returns every rank's figures.
"""
from __future__ import annotations

import resource
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch import nn

from ..engines import comm
from ..training.accumulate import Accumulator
from ..training.batches import cross_entropy
from ..job.build import replicated_model
from ..job.datasets import build_dataset, synthetic
from ..job.models import LANGUAGE_MODELS, model_key
from ..training.precision import Precision, gpu_math
from ..training.runtime import Runtime, setup

__all__ = ["run_row", "optimizer_state_bytes"]

Batch = Tuple[torch.Tensor, torch.Tensor]


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of tensors this rank holds in the optimizer state (ZeRO: only its own shard).

    Example::

        optimizer_state_bytes(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    """
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard there
    return sum(_local_bytes(t) for state in local.state.values()
               for t in state.values() if torch.is_tensor(t))


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # FSDP's DTensor: this rank's shard
    return t.numel() * t.element_size()


def model_state_bytes(model: nn.Module, optimizer: Any) -> int:
    """Bytes this rank holds for the model between steps: parameters, optimizer state and any
    gradients still alive (none after ``zero_grad(set_to_none=True)``). FSDP: its shards; ZeRO:
    full parameters, its optimizer shard.

    Example::

        model_state_bytes(model, opt) / 2**20   # MB per rank
    """
    params = sum(_local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0)
                 for p in model.parameters())
    return params + optimizer_state_bytes(optimizer)


def _datasets(job: Dict[str, Any]) -> Tuple[Any, Any]:
    if model_key(job["model"]) in LANGUAGE_MODELS:  # byte-level text: ddpkit's own sources
        return (build_dataset("text", train=True),
                build_dataset("text", train=False) if job["accuracy"] else None)
    if job["accuracy"]:
        return build_dataset("digits", train=True), build_dataset("digits", train=False)
    # Lazily generated: the stated epoch size costs no memory and every rank sees the same data.
    return synthetic(job["epoch_size"], shape=(3, 32, 32), num_classes=100, seed=job["seed"]), None


def _model(job: Dict[str, Any], rt: Runtime, train_set: Any) -> nn.Module:
    # PowerSGD compresses from step 10 by default; a short benchmark must time compressed steps
    # (2 is the earliest PowerSGD allows with error feedback).
    return replicated_model(rt, job["model"], train_set, job["seed"], job["channels_last"],
                            engine=job["engine"], sync_bn=job["sync_bn"],
                            comm_hook=job["comm_hook"], powersgd_start_iter=2,
                            compile=job.get("compile", False))


def _optimizer(job: Dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    if job["zero"]:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                       lr=job["lr"], momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=job["lr"], momentum=0.9)


def _batches(loader: Any) -> Iterator[Batch]:
    while True:  # every pass over a DistributedLoader is the next epoch (set_epoch included)
        yield from loader


def _step_fn(job: Dict[str, Any], rt: Runtime, model: nn.Module, opt: torch.optim.Optimizer,
             prec: Precision) -> Callable[[Iterator[Batch]], torch.Tensor]:
    """One optimizer step over ``job['accum']`` micro-batches, in the row's way of accumulating."""
    k, loss_fn = job["accum_k"] if job["accum"] else 1, cross_entropy  # any logits shape
    acc = Accumulator(model, opt, prec, steps=k)

    def forward(batches: Iterator[Batch]) -> torch.Tensor:
        x, y = rt.to_device(*next(batches))
        if job["channels_last"] and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with prec.autocast():
            return loss_fn(model(x), y)

    def step(batches: Iterator[Batch]) -> torch.Tensor:
        for _ in range(k):
            if job["accum"] == "naive":  # the tutorials' way: every backward all-reduces
                loss = forward(batches)
                prec.backward(loss / k)
            else:  # ddpkit's Accumulator: no_sync on all but the last micro-step
                with acc.micro_step():
                    loss = forward(batches)
                    acc.backward(loss)
        if job["accum"] == "naive":
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _time_steps(step: Callable[[Iterator[Batch]], torch.Tensor], batches: Iterator[Batch],
                total: int, warmup: int, device: torch.device) -> Tuple[List[float], List[float]]:
    """Wall and CPU seconds per optimizer step after ``warmup`` untimed steps (data included).

    CPU time over wall time shows how much of its cores the rank really got on a shared machine.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    wall, cpu = [], []
    for i in range(total):
        start, start_cpu = time.perf_counter(), time.process_time()
        step(batches)
        sync()  # on CPU the work is done when optimizer.step returns
        if i >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _loader(job: Dict[str, Any], rt: Runtime, train_set: Any) -> Any:
    return rt.loader(train_set, batch_size=job["batch"] * rt.world_size,
                     accum_steps=job["accum_k"] if job["accum"] else 1,
                     seed=job["seed"], num_workers=job["workers"], drop_last=True,
                     resident=job.get("device_data", "auto"))


def run_row(job: Dict[str, Any]) -> Dict[str, Any]:
    """Measure one row on this rank; rank 0 gets ``{"ranks": [per-rank figures]}``.

    Example::

        ddpkit.launch(run_row, 2, {"model": "resnet18", "batch": 64, ...})
    """
    rt = setup(seed=job["seed"], backend=job.get("backend"))
    gpu_math(rt.device)  # TF32 and cuDNN autotuning, as `ddpkit train` runs
    torch.set_num_threads(job["threads"])  # explicit: the row defines the threads, not the env
    train_set, test_set = _datasets(job)
    model = _model(job, rt, train_set)
    # Under the Horovod engine (the horovod row) its DistributedOptimizer averages gradients.
    opt = rt.optimizer(_optimizer(job, model), model, job["accum_k"] if job["accum"] else 1)
    prec = Precision(job["precision"], rt.device)
    loader = _loader(job, rt, train_set)
    total = job["warmup"] + job["steps"]
    if job["accuracy"]:  # a fixed budget of epochs; the first warm-up steps are not timed
        total = job["epochs"] * max(1, len(loader) // (job["accum_k"] if job["accum"] else 1))
    model.train()
    times, cpu = _time_steps(_step_fn(job, rt, model, opt, prec), _batches(loader), total,
                             min(job["warmup"], total - 1), rt.device)
    mine = {"rank": rt.rank, "step_s": times, "cpu_s": cpu, "peak_mb": _peak_mb(rt.device),
            "opt_state_mb": optimizer_state_bytes(opt) / 2**20,
            "held_mb": model_state_bytes(model, opt) / 2**20,
            "threads": torch.get_num_threads(), "device": str(rt.device), "steps_total": total}
    if test_set is not None:
        mine["top1"] = rt.evaluate(model, test_set, per_rank_batch=256, precision=prec,
                                   channels_last=job["channels_last"])["top1"]
    ranks = comm.gather_object(mine)
    return {"ranks": ranks, "backend": rt.backend, "world_size": rt.world_size}
