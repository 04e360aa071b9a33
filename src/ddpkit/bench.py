"""``ddpkit bench``: the tutorials' DP / DDP / AMP / Horovod table, measured here, honestly.

Each row runs in fresh worker processes; rows are interleaved round by round so drift is shared.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .errors import ConfigError

__all__ = ["Row", "ROWS", "BenchConfig", "parse_rows", "skip_reason", "run_bench", "add_parser"]


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
    strategy: str = "ddp"
    precision: str = "fp32"
    channels_last: bool = False
    accum: str = ""             # "" | "nosync" (ddpkit Accumulator) | "naive" (sync every micro-step)
    comm_hook: Optional[str] = None
    sync_bn: bool = False
    zero: bool = False
    engine: str = "ddpkit"      # or "horovod"


#: Every row, in table order.
ROWS: Dict[str, Row] = {r.name: r for r in (
    Row("single-1t", "one process, one thread (the efficiency baseline)", single=True,
        strategy="none"),
    Row("single-all", "one process, every core", single=True, all_threads=True, strategy="none"),
    Row("dp", "nn.DataParallel over all GPUs in one process", single=True, strategy="dp"),
    Row("indep", "N independent processes, no communication (isolates core/memory contention)",
        strategy="none"),
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
    Row("horovod", "Horovod over gloo, N processes", engine="horovod"),
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
    batch: int = 64
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
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got "
                                  f"{getattr(self, name)}")
        if self.warmup < 0 or self.workers < 0:
            raise ConfigError("--warmup and --workers must be >= 0")
        accum = any(ROWS[r].accum for r in self.rows)
        if accum and self.batch % self.accum_steps:
            raise ConfigError(f"--batch {self.batch} cannot be split into --accum-steps "
                              f"{self.accum_steps} micro-batches; choose a multiple of it")
        _check_model(self.model)


def _check_model(name: str) -> None:
    from .models import available_models

    key = name.lower().replace("-", "_")
    if key not in available_models() and not key.startswith("torchvision:"):
        raise ConfigError(f"unknown model {name!r}; valid models: "
                          f"{', '.join(available_models())}, or torchvision:NAME")


# --------------------------------------------------------------------------- what can run here

def capabilities(cfg: BenchConfig) -> Dict[str, Any]:
    """What this machine offers the rows: CUDA devices, Horovod, native bf16 (probed if needed).

    Example::

        capabilities(BenchConfig())["cuda_count"]   # 0 here
    """
    import torch

    from .bench_env import bf16_slowdown, cpu_info, horovod_missing, native_bf16

    caps: Dict[str, Any] = {"cuda_count": torch.cuda.device_count(), "bf16_slowdown": None}
    caps["horovod_missing"] = horovod_missing() if "horovod" in cfg.rows else None
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
    if row.strategy == "dp" and cuda < 2:
        return f"needs >= 2 CUDA devices (found {cuda})"
    if row.precision == "fp16" and not cuda:
        return "fp16 autocast + GradScaler needs CUDA; on CPU the mixed precision is bf16"
    if row.sync_bn and not cuda:
        return "PyTorch refuses SyncBatchNorm on CPU (it needs CUDA tensors)"
    if row.comm_hook == "bf16" and not cuda:
        return "PyTorch's bf16_compress_hook needs CUDA 11+ with NCCL 2.10+ (or XPU); not gloo"
    if row.engine == "horovod" and caps.get("horovod_missing"):
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
    threads = (os.cpu_count() or 1) if row.all_threads else 1 if row.single else cfg.threads
    devices = caps["cuda_count"] if row.strategy == "dp" else 1
    job = dict(model=cfg.model, batch=cfg.batch * devices, threads=threads, steps=cfg.steps,
               warmup=cfg.warmup, precision=row.precision, channels_last=row.channels_last,
               strategy=row.strategy, accum=row.accum, accum_k=cfg.accum_steps,
               comm_hook=row.comm_hook, sync_bn=row.sync_bn, zero=row.zero,
               accuracy=cfg.accuracy, epochs=cfg.epochs, lr=cfg.lr, seed=cfg.seed,
               workers=cfg.workers, epoch_size=cfg.epoch_size)
    return {"nprocs": nprocs, "threads": threads, "workers": nprocs * threads,
            "global_batch": nprocs * cfg.batch * devices, "engine": row.engine, "job": job}


# --------------------------------------------------------------------------- measuring

def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    last = lines[-1] if lines else ""
    return head if head == last else f"{head.rstrip(':')} {last}"


def measure(plan: Dict[str, Any], cfg: BenchConfig) -> Dict[str, Any]:
    """Run one row once in fresh processes; its figures, or ``{"error": one line}``.

    Example::

        measure(plan_row(ROWS["ddp"], cfg, caps), cfg)["images_s"]
    """
    from .bench_report import repeat_figures

    start = time.perf_counter()
    try:
        result = _launch(plan, cfg)
    except TimeoutError:
        return {"error": f"timed out after {cfg.row_timeout:.0f} s (--row-timeout)"}
    except Exception as exc:  # a failing row is reported, never the end of the bench
        return {"error": _one_line(exc)}
    ranks = result["ranks"]
    out = repeat_figures([r["step_s"] for r in ranks], plan["global_batch"])
    out.update(step_s=[r["step_s"] for r in ranks], peak_mb=[r["peak_mb"] for r in ranks],
               opt_state_mb=[r["opt_state_mb"] for r in ranks],
               threads=[r["threads"] for r in ranks], top1=ranks[0].get("top1"),
               steps_total=ranks[0]["steps_total"], wall_s=time.perf_counter() - start)
    return out


def _launch(plan: Dict[str, Any], cfg: BenchConfig) -> Dict[str, Any]:
    if plan["engine"] == "horovod":
        from .bench_horovod import launch_horovod
        return launch_horovod(plan, cfg.row_timeout)
    from .bench_worker import run_row
    from .launchers import launch
    return launch(run_row, plan["nprocs"], plan["job"], timeout=cfg.row_timeout)


def _records(cfg: BenchConfig, caps: Dict[str, Any]) -> List[Dict[str, Any]]:
    records = []
    for name in cfg.rows:
        row = ROWS[name]
        reason = skip_reason(row, cfg, caps)
        records.append({"name": name, "help": row.help, "status": "skipped" if reason else "ok",
                        "reason": reason, "plan": plan_row(row, cfg, caps), "repeats": []})
    return records


def _progress(rnd: int, cfg: BenchConfig, rec: Dict[str, Any], res: Dict[str, Any]) -> None:
    tag = f"[round {rnd + 1}/{cfg.repeats}] {rec['name']}"
    if "error" in res:
        print(f"{tag}: failed: {res['error']}", flush=True)
    else:
        top1 = f", top-1 {res['top1']:.2f}%" if res.get("top1") is not None else ""
        print(f"{tag}: {res['images_s']:.1f} images/s, step {res['step_ms_median']:.0f} ms "
              f"median / {res['step_ms_p95']:.0f} ms p95{top1}", flush=True)


def run_rounds(cfg: BenchConfig, records: List[Dict[str, Any]]) -> int:
    """for round: for row: measure -- so machine drift is shared by every row of a round.

    Round 1 always runs; a further round starts only if, at the last round's pace, it ends
    within ``cfg.budget`` seconds of the start. Returns the number of rounds done.

    Example::

        rounds = run_rounds(cfg, records)   # fills records[i]["repeats"]
    """
    start, done = time.perf_counter(), 0
    for rnd in range(cfg.repeats):
        began = time.perf_counter()
        if rnd and began - start + (began - start) / rnd > cfg.budget:
            break
        for rec in records:
            if rec["status"] != "ok":
                continue  # skipped, or failed in an earlier round: once is enough
            res = measure(rec["plan"], cfg)
            res["round"] = rnd
            _progress(rnd, cfg, rec, res)
            if "error" in res:
                rec["status"], rec["reason"] = "failed", res["error"]
            rec["repeats"].append(res)
        done += 1
    return done


def _settings(cfg: BenchConfig) -> Dict[str, Any]:
    return {"model": cfg.model, "data": "digits (real, 8x8)" if cfg.accuracy else
            "synthetic CIFAR-100-shaped (3x32x32, 100 classes)", "batch_per_rank": cfg.batch,
            "nproc": cfg.nproc, "threads_per_process": cfg.threads, "steps": cfg.steps,
            "warmup": cfg.warmup, "repeats": cfg.repeats, "epoch_size": cfg.epoch_size,
            "accuracy": cfg.accuracy, "epochs": cfg.epochs if cfg.accuracy else None,
            "accum_steps": cfg.accum_steps, "loader_workers": cfg.workers, "lr": cfg.lr,
            "seed": cfg.seed, "rows_requested": cfg.rows}


def run_bench(cfg: BenchConfig) -> Dict[str, Any]:
    """Measure every requested row, write the report into ``cfg.output``; returns the summary.

    Example::

        result = run_bench(BenchConfig(rows=["single-1t", "ddp"], quick=True))
        print(result["table"])
    """
    from .bench_env import environment
    from .bench_report import render_table, summarize, write_outputs

    cfg.check()
    started = time.perf_counter()
    env = environment(_settings(cfg))
    caps = capabilities(cfg)
    env["capabilities"] = caps
    records = _records(cfg, caps)
    env["rounds_done"] = run_rounds(cfg, records)
    notes = [] if env["rounds_done"] == cfg.repeats else [
        f"{env['rounds_done']} of {cfg.repeats} rounds: another would have ended past "
        f"--budget {cfg.budget:.0f} s"]
    env["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    env["bench_seconds"] = round(time.perf_counter() - started, 1)
    base = next((r for r in records if r["name"] == "single-1t" and r["status"] == "ok"), None)
    summaries = [summarize(r, base, cfg.epoch_size) for r in records]
    notes += write_outputs(cfg.output, summaries, records, env, notes)
    return {"table": render_table(summaries, cfg.accuracy), "summary": summaries,
            "notes": notes, "seconds": env["bench_seconds"]}


# --------------------------------------------------------------------------- command line

def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit bench``.

    Example::

        add_parser(parser.add_subparsers())
    """
    p = sub.add_parser("bench", help="measure DP / DDP / AMP / comm hooks / ZeRO / Horovod rows",
                       description="Measure a matrix of data-parallel configurations on one "
                                   "workload, each row in fresh processes, rows interleaved.")
    p.add_argument("--rows", help=f"comma-separated rows (default: all but indep, ddp-cl): {', '.join(ROWS)}")
    p.add_argument("--model", help="built-in model (default resnet18; small_cnn with --quick "
                                   "or --accuracy)")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch per optimizer step")
    p.add_argument("--nproc", type=int, default=2, help="processes of the multi-process rows")
    p.add_argument("--threads", type=int, default=1, help="threads per process (DDP rows)")
    p.add_argument("--steps", type=int, help="timed optimizer steps per row and round")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 1; 2 with --quick)")
    p.add_argument("--repeats", type=int, help="interleaved rounds over all rows (default 3; "
                   "fewer if --budget runs out; 1 with --quick or --accuracy)")
    p.add_argument("--epoch-size", type=int, help="samples per stated epoch (default 50000)")
    p.add_argument("--accuracy", action="store_true",
                   help="train each row on the real digits dataset and report exact top-1")
    p.add_argument("--epochs", type=int, default=5, help="accuracy mode: epochs per row")
    p.add_argument("--accum-steps", type=int, default=4, help="K of the accumulation rows")
    p.add_argument("--workers", type=int, default=0, help="data-loader workers per process")
    p.add_argument("--row-timeout", type=float, default=900.0, help="seconds before a row fails")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds: no further round starts that would end later (round 1 always "
                        "runs)")
    p.add_argument("--quick", action="store_true", help="small model, 3 rows, 1 round (< 2 min)")
    p.add_argument("--output", default="bench-out", help="directory for results.md/json, chart")
    p.set_defaults(func=_cmd_bench)


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    """Flags over the mode's defaults (full, ``--quick`` or ``--accuracy``).

    Example::

        config_from_args(build_parser().parse_args(["bench", "--quick"]))
    """
    quick, acc = ns.quick, ns.accuracy
    small = quick or acc
    rows = parse_rows(ns.rows) if ns.rows else list(QUICK_ROWS if quick else DEFAULT_ROWS)
    epoch_size = ns.epoch_size or (_digits_size() if acc else 50_000)
    return BenchConfig(
        rows=rows, rows_given=bool(ns.rows), model=ns.model or ("small_cnn" if small else
                                                                 "resnet18"),
        batch=ns.batch, nproc=ns.nproc, threads=ns.threads,
        steps=ns.steps or (5 if quick else 3), warmup=(2 if quick else 1) if ns.warmup is None else ns.warmup,
        repeats=ns.repeats or (1 if small else 3), epoch_size=epoch_size, accuracy=acc,
        epochs=ns.epochs, accum_steps=ns.accum_steps, workers=ns.workers,
        lr=0.05 if acc else 0.1, row_timeout=ns.row_timeout, budget=ns.budget, output=ns.output, quick=quick)


def _digits_size() -> int:
    from .datasets import build_dataset
    return len(build_dataset("digits", train=True))


def _cmd_bench(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    print(f"ddpkit bench: rows {', '.join(cfg.rows)}; model {cfg.model}, per-rank batch "
          f"{cfg.batch}, {cfg.nproc} processes x {cfg.threads} thread(s), {cfg.repeats} "
          f"round(s); output {cfg.output}/", flush=True)
    result = run_bench(cfg)
    print("\n" + result["table"], end="")
    for note in result["notes"]:
        print(f"note: {note}")
    chart = os.path.exists(os.path.join(cfg.output, "chart.png"))
    print(f"done in {result['seconds']:.0f} s; wrote {os.path.join(cfg.output, 'results.md')}, "
          f"results.json{', chart.png' if chart else ''}", flush=True)
    return 0
