"""``ddpkit bench``: the tutorials' DP / DDP / AMP / Horovod table, measured here, honestly.

Each row runs in fresh worker processes; rows are interleaved round by round so drift is shared.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict, List

from .bench_rows import (DEFAULT_ROWS, QUICK_ROWS, ROWS, BenchConfig, Row, capabilities,
                         parse_rows, plan_row, skip_reason)

__all__ = ["Row", "ROWS", "BenchConfig", "parse_rows", "skip_reason", "plan_row", "run_bench",
           "add_parser", "config_from_args"]


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
    from .bench_report import cpu_share, repeat_figures

    start = time.perf_counter()
    try:
        result = _launch(plan, cfg)
    except TimeoutError:
        return {"error": f"timed out after {cfg.row_timeout:.0f} s (--row-timeout)"}
    except Exception as exc:  # a failing row is reported, never the end of the bench
        return {"error": _one_line(exc)}
    ranks = result["ranks"]
    out = repeat_figures([r["step_s"] for r in ranks], plan["global_batch"])
    threads = [r["threads"] for r in ranks]
    out.update(cpu_share=cpu_share([r["step_s"] for r in ranks], [r["cpu_s"] for r in ranks],
                                   threads), cpu_s=[r["cpu_s"] for r in ranks])
    out.update(step_s=[r["step_s"] for r in ranks], peak_mb=[r["peak_mb"] for r in ranks],
               opt_state_mb=[r["opt_state_mb"] for r in ranks],
               threads=threads, top1=ranks[0].get("top1"), load_average=_loadavg(),
               steps_total=ranks[0]["steps_total"], wall_s=time.perf_counter() - start)
    return out


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0


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
              f"median / {res['step_ms_p95']:.0f} ms p95, CPU share {res['cpu_share']:.2f}, "
              f"load {res['load_average']}{top1}", flush=True)


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
    p.add_argument("--rows", help="comma-separated rows (default: all but indep, ddp-cl): "
                                  + ", ".join(ROWS))
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
        steps=ns.steps or (5 if quick else 3),
        warmup=(2 if quick else 1) if ns.warmup is None else ns.warmup,
        repeats=ns.repeats or (1 if small else 3), epoch_size=epoch_size, accuracy=acc,
        epochs=ns.epochs, accum_steps=ns.accum_steps, workers=ns.workers,
        lr=0.05 if acc else 0.1, row_timeout=ns.row_timeout, budget=ns.budget,
        output=ns.output, quick=quick)


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
