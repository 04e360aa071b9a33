"""The matrix of ``ddpkit bench``: the rows, the run's configuration, what can run on this machine.

Pure except :func:`capabilities`, which looks at the devices, Horovod and the CPU's bf16 support.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..base.errors import ConfigError
from ..data.batch import Batch

__all__ = ["Row", "ROWS", "DEFAULT_ROWS", "QUICK_ROWS", "parse_rows", "BenchConfig",
           "capabilities", "skip_reason", "plan_row"]


@dataclass(frozen=True)
class Row:
    """One configuration of the matrix: how many processes, which precision, which DDP knobs.

    Example::

        Row("ddp-bf16", "DDP + bf16 autocast", precision="bf16")
    """

    name: str
    help: str
    single: bool = False        # one process (the baselines and DataParallel)
    all_threads: bool = False   # every core in that one process
    engine: str = "ddp"
    precision: str = "fp32"
    channels_last: bool = False
    accum: str = ""  # "" | "nosync" (ddpkit Accumulator) | "naive" (sync each micro-step)
    comm_hook: Optional[str] = None
    sync_bn: bool = False
    zero: bool = False
    runner: str = "ddpkit"      # how the row's processes start: ddpkit run, or horovodrun
    gpu: bool = False           # one process on one GPU (skipped without CUDA)
    device_data: str = "auto"   # data on the device (auto: on a GPU when it fits) or "off"
    compile: bool = False       # torch.compile


#: Every row, in table order.
ROWS: Dict[str, Row] = {r.name: r for r in (
    Row("single-1t", "one process, one thread (the efficiency baseline)", single=True,
        engine="none"),
    Row("single-all", "one process, every core", single=True, all_threads=True, engine="none"),
    Row("dp", "nn.DataParallel over all GPUs in one process", single=True, engine="dp"),
    Row("indep", "N independent processes, no communication (isolates core/memory contention)",
        engine="none"),
    Row("ddp", "DDP over N processes, fp32 (the tutorials' script)"),
    Row("ddp-cl", "DDP, fp32, channels_last", channels_last=True),
    Row("ddp-bf16", "DDP + bf16 autocast", precision="bf16"),
    Row("ddp-bf16-cl", "DDP + bf16 + channels_last", precision="bf16", channels_last=True),
    Row("ddp-fp16", "DDP + fp16 autocast + GradScaler (CUDA)", precision="fp16"),
    Row("ddp-accum", "DDP, K micro-batches with no_sync (ddpkit Accumulator)", accum="nosync"),
    Row("ddp-accum-naive", "DDP, K micro-batches all-reducing every micro-step", accum="naive"),
    Row("ddp-syncbn", "DDP + SyncBatchNorm", sync_bn=True),
    Row("ddp-hook-fp16", "DDP, gradients all-reduced in fp16 (comm hook)", comm_hook="fp16"),
    Row("ddp-hook-bf16", "DDP, gradients all-reduced in bf16 (comm hook)", comm_hook="bf16"),
    Row("ddp-powersgd", "DDP + PowerSGD rank-2 compression (comm hook)", comm_hook="powersgd"),
    Row("zero", "DDP + ZeroRedundancyOptimizer (optimizer state sharded)", zero=True),
    Row("fsdp", "FSDP2 fully_shard: parameters, gradients and optimizer state sharded",
        engine="fsdp"),
    Row("horovod", "Horovod over gloo, N processes", runner="horovod"),
    # One GPU: precision, memory format, compilation and where the data lives.
    Row("gpu-fp32", "one process on one GPU, fp32 (TF32 matmuls), data on the GPU", single=True,
        engine="none", gpu=True),
    Row("gpu-bf16", "one GPU, bf16 autocast", single=True, engine="none", gpu=True,
        precision="bf16"),
    Row("gpu-fp16", "one GPU, fp16 autocast + GradScaler", single=True, engine="none",
        gpu=True, precision="fp16"),
    Row("gpu-bf16-cl", "one GPU, bf16 + channels_last", single=True, engine="none", gpu=True,
        precision="bf16", channels_last=True),
    Row("gpu-compile", "one GPU, bf16 + channels_last + torch.compile", single=True,
        engine="none", gpu=True, precision="bf16", channels_last=True, compile=True),
    Row("gpu-cpu-loader", "one GPU, bf16 + channels_last, batches from the CPU loader "
        "(per-item dataset + collate + copy)", single=True, engine="none", gpu=True,
        precision="bf16", channels_last=True, device_data="off"),
)}

#: Rows run when --rows is not given. ``indep`` and ``ddp-cl`` are diagnostics: ask for them.
DEFAULT_ROWS = tuple(n for n in ROWS if n not in ("indep", "ddp-cl"))
QUICK_ROWS = ("single-1t", "ddp", "dp")


def parse_rows(text: str) -> List[str]:
    """Row names from ``--rows a,b,c`` in order, duplicates dropped; unknown names are an error.

    Example::

        parse_rows("single-1t, ddp")   # ['single-1t', 'ddp']
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        what = f"unknown row(s) {', '.join(unknown)}" if unknown else "no rows given"
        raise ConfigError(f"{what}; valid rows: {', '.join(ROWS)}")
    return list(dict.fromkeys(names))


@dataclass
class BenchConfig:
    """Everything a bench run was asked for (the CLI resolves flags and modes into this).

    Example::

        run_bench(BenchConfig(rows=["single-1t", "ddp"], steps=5, output="bench-out"))
    """

    rows: List[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_ROWS))
    rows_given: bool = False
    model: str = "resnet18"
    batch: int = 64          #: per rank, per optimizer step (--per-rank-batch)
    nproc: int = 2
    threads: int = 1
    steps: int = 3
    warmup: int = 1
    repeats: int = 3
    epoch_size: int = 50_000
    accuracy: bool = False
    epochs: int = 5
    accum_steps: int = 4
    workers: int = 0
    lr: float = 0.1
    seed: int = 0
    row_timeout: float = 900.0
    budget: float = 540.0
    output: str = "bench-out"
    quick: bool = False

    def check(self) -> None:
        """Reject impossible settings with one line each."""
        for name in ("batch", "nproc", "threads", "steps", "repeats", "epoch_size", "epochs",
                     "accum_steps"):
            if getattr(self, name) < 1:
                flag = "per-rank-batch" if name == "batch" else name.replace("_", "-")
                raise ConfigError(f"--{flag} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.workers < 0:
            raise ConfigError("--warmup and --workers must be >= 0")
        accum = any(ROWS[r].accum for r in self.rows)
        if accum and self.batch % self.accum_steps:
            raise ConfigError(f"--per-rank-batch {self.batch} cannot be split into --accum-steps "
                              f"{self.accum_steps} micro-batches; choose a multiple of it")
        _check_model(self.model)


def _check_model(name: str) -> None:
    from ..job.models import available_models, is_torchvision, model_key

    if model_key(name) not in available_models() and not is_torchvision(name):
        raise ConfigError(f"unknown model {name!r}; valid models: "
                          f"{', '.join(available_models())}, or torchvision:NAME")


# --------------------------------------------------------------------------- what can run here

def capabilities(cfg: BenchConfig) -> Dict[str, Any]:
    """What this machine offers the rows: CUDA devices, Horovod, native bf16 (probed if needed).

    Example::

        capabilities(BenchConfig())["cuda_count"]   # 0 here
    """
    import torch

    from ..engines import create
    from ..env.machine import bf16_slowdown, cpu_info, native_bf16

    caps: Dict[str, Any] = {"cuda_count": torch.cuda.device_count(), "bf16_slowdown": None}
    caps["horovod_missing"] = create("horovod").unavailable() if "horovod" in cfg.rows else None
    caps["native_bf16"] = caps["cuda_count"] > 0 or native_bf16(cpu_info()["flags"])
    wants_bf16 = any(ROWS[r].precision == "bf16" for r in cfg.rows)
    if wants_bf16 and not caps["native_bf16"]:
        caps["bf16_slowdown"] = round(bf16_slowdown(), 1)
    return caps


def skip_reason(row: Row, cfg: BenchConfig, caps: Dict[str, Any]) -> Optional[str]:
    """Why ``row`` cannot (or, by default, should not) run here; None if it runs.

    Example::

        skip_reason(ROWS["dp"], BenchConfig(), {"cuda_count": 0})   # 'needs >= 2 CUDA devices'
    """
    cuda = caps["cuda_count"]
    if row.gpu and not cuda:
        return "needs a CUDA GPU (found none)"
    if row.engine == "dp" and cuda < 2:
        return f"needs >= 2 CUDA devices (found {cuda})"
    if row.precision == "fp16" and not cuda:
        return "fp16 autocast + GradScaler needs CUDA; on CPU the mixed precision is bf16"
    if row.sync_bn and not cuda:
        return "PyTorch refuses SyncBatchNorm on CPU (it needs CUDA tensors)"
    if row.runner == "horovod" and caps.get("horovod_missing"):
        return caps["horovod_missing"]
    if not row.single and cfg.nproc < 2:
        return "needs --nproc >= 2"
    if row.precision == "bf16" and not caps.get("native_bf16", True) and not cfg.rows_given \
            and not cfg.accuracy:
        return (f"this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag): a bf16 conv runs "
                f"{caps['bf16_slowdown']}x slower than fp32 here, minutes per step; "
                f"measure anyway with --rows {row.name}")
    return None


def plan_row(row: Row, cfg: BenchConfig, caps: Dict[str, Any]) -> Dict[str, Any]:
    """Processes, threads and the worker's job for ``row`` (all picklable).

    Example::

        plan_row(ROWS["ddp"], BenchConfig(), caps)["nprocs"]   # 2
    """
    nprocs = 1 if row.single else cfg.nproc
    # More processes than GPUs: they share them over gloo (NCCL cannot), which shows DDP works
    # there but measures nothing a real multi-GPU job would see.
    sharing = 0 < caps["cuda_count"] < nprocs and row.runner == "ddpkit"
    threads = (os.cpu_count() or 1) if row.all_threads else 1 if row.single else cfg.threads
    # DataParallel takes every GPU (none: the module runs as it is, on the CPU)
    devices = max(1, caps["cuda_count"]) if row.engine == "dp" else 1
    # --per-rank-batch is a process's (DataParallel: a GPU's) samples per optimizer step
    batch = Batch.of(nprocs * cfg.batch * devices, nprocs, cfg.accum_steps if row.accum else 1)
    job = dict(model=cfg.model, batch=cfg.batch * devices, threads=threads, steps=cfg.steps,
               warmup=cfg.warmup, precision=row.precision, channels_last=row.channels_last,
               engine=row.engine, accum=row.accum, accum_k=cfg.accum_steps,
               comm_hook=row.comm_hook, sync_bn=row.sync_bn, zero=row.zero,
               accuracy=cfg.accuracy, epochs=cfg.epochs, lr=cfg.lr, seed=cfg.seed,
               workers=cfg.workers, epoch_size=cfg.epoch_size, device_data=row.device_data,
               compile=row.compile, backend="gloo" if sharing else None)
    return {"nprocs": nprocs, "threads": threads, "workers": nprocs * threads,
            "global_batch": batch.global_batch, "runner": row.runner, "job": job,
            "functional": (f"functional, not speed: {nprocs} processes share "
                           f"{caps['cuda_count']} GPU(s) over gloo") if sharing else None}
