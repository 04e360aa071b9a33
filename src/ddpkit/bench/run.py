"""Running ``ddpkit bench``: every row in fresh processes, rows interleaved round by round so
machine drift is shared by all of them, then the report written.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List

from ..env.machine import loadavg
from .rows import ROWS, BenchConfig, capabilities, plan_row, skip_reason

__all__ = ["measure", "run_rounds", "run_bench"]


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
    from .report import cpu_share, repeat_figures

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
               held_mb=[r.get("held_mb", 0.0) for r in ranks],
               threads=threads, top1=ranks[0].get("top1"), load_average=(loadavg() or [-1.0])[0],
               steps_total=ranks[0]["steps_total"], wall_s=time.perf_counter() - start)
    return out


def _launch(plan: Dict[str, Any], cfg: BenchConfig) -> Dict[str, Any]:
    if plan["runner"] == "horovod":
        from .horovod import launch_horovod
        return launch_horovod(plan, cfg.row_timeout)
    from .worker import run_row
    from ..launchers.spawn import launch
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
    from .environment import environment
    from .report import render_table, summarize, write_outputs

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
    env["load_average_end"] = loadavg()
    env["bench_seconds"] = round(time.perf_counter() - started, 1)
    base = next((r for r in records if r["name"] == "single-1t" and r["status"] == "ok"), None)
    summaries = [summarize(r, base, cfg.epoch_size) for r in records]
    notes += write_outputs(cfg.output, summaries, records, env, notes)
    return {"table": render_table(summaries, cfg.accuracy), "summary": summaries,
            "notes": notes, "seconds": env["bench_seconds"]}
