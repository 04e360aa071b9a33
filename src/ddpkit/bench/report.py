"""Figures and files of ``ddpkit bench``: statistics, the Markdown table, JSON and the chart.

Pure functions over the raw per-step times, so every figure in a report can be recomputed.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["median", "percentile", "efficiency", "repeat_figures", "cpu_share", "summarize",
           "render_table", "write_outputs"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, as ``numpy.percentile``.

    Example::

        percentile([1, 2, 3, 4], 95)   # 3.85
    """
    if not values:
        raise ValueError("percentile of no values")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """The median (mean of the middle two for an even count).

    Example::

        median([3, 1, 2, 10])   # 2.5
    """
    return percentile(values, 50)


def efficiency(images_s: float, workers: int, single_images_s: float) -> float:
    """Scaling efficiency: throughput over ``workers`` times the single-thread single-process one.

    ``workers`` is processes x threads per process, so 2 single-thread DDP processes at exactly
    twice the single-process throughput score 1.0.

    Example::

        efficiency(95.0, 2, 50.0)   # 0.95
    """
    if workers < 1 or single_images_s <= 0:
        raise ValueError("efficiency needs workers >= 1 and a positive baseline")
    return images_s / (workers * single_images_s)


def repeat_figures(step_s_per_rank: List[List[float]], global_batch: int) -> Dict[str, float]:
    """Median / p95 step time and images/s of one measurement; the slowest rank sets each step.

    Example::

        repeat_figures([[1.0, 1.2], [1.1, 1.0]], global_batch=128)["images_s"]   # 116.4
    """
    steps = [max(ts) for ts in zip(*step_s_per_rank)]
    med = median(steps)
    return {"step_ms_median": 1000 * med, "step_ms_p95": 1000 * percentile(steps, 95),
            "images_s": global_batch / med}


def cpu_share(wall_s: List[List[float]], cpu_s: List[List[float]], threads: List[int]) -> float:
    """CPU seconds the ranks got per wall second and thread, averaged over ranks (1.0 = all).

    Below 1 the rank waited: for a peer in a collective, or for cores other programs held.

    Example::

        cpu_share([[2.0, 2.0]], [[1.0, 1.0]], [1])   # 0.5
    """
    shares = [sum(c) / (sum(w) * t) for w, c, t in zip(wall_s, cpu_s, threads) if sum(w) > 0]
    return sum(shares) / len(shares) if shares else 0.0


def _range(values: Sequence[float]) -> Optional[List[float]]:
    return [min(values), max(values)] if values else None


def _paired_efficiency(reps: List[Dict[str, Any]], base: Optional[List[Dict[str, Any]]],
                       workers: int) -> List[float]:
    """Efficiency per round against the baseline of the same round, so drift cancels."""
    if not base:
        return []
    by_round = {b["round"]: b["images_s"] for b in base}
    return [efficiency(r["images_s"], workers, by_round[r["round"]])
            for r in reps if r["round"] in by_round]


def summarize(row: Dict[str, Any], baseline: Optional[Dict[str, Any]],
              epoch_size: int) -> Dict[str, Any]:
    """One row's reported figures: medians across rounds and the min-max spread.

    Example::

        summarize(record, records.get("single-1t"), 50_000)["images_s"]
    """
    out: Dict[str, Any] = {"row": row["name"], "status": row["status"], "reason": row["reason"],
                           "functional": row.get("plan", {}).get("functional")}
    reps = [r for r in row["repeats"] if "images_s" in r]
    if not reps:
        return out
    ips = [r["images_s"] for r in reps]
    eff = _paired_efficiency(reps, baseline and [b for b in baseline["repeats"]
                                                  if "images_s" in b], row["plan"]["workers"])
    out.update(images_s=median(ips), images_s_range=_range(ips),
               s_per_epoch=epoch_size / median(ips),
               step_ms_median=median([r["step_ms_median"] for r in reps]),
               step_ms_p95=median([r["step_ms_p95"] for r in reps]),
               efficiency=median(eff) if eff else None, efficiency_range=_range(eff),
               peak_mb=max(max(r["peak_mb"]) for r in reps),
               opt_state_mb=max(max(r["opt_state_mb"]) for r in reps), rounds=len(reps),
               held_mb=max(max(r.get("held_mb", [0.0])) for r in reps),
               cpu_share=median([r["cpu_share"] for r in reps if "cpu_share" in r] or [0.0]))
    tops = [r["top1"] for r in reps if r.get("top1") is not None]
    out["top1"] = median(tops) if tops else None
    return out


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _span(pair: Optional[List[float]], spec: str) -> str:
    lo, hi = (format(v, spec) for v in pair) if pair else ("", "")
    return "" if lo == hi else f" ({lo}-{hi})"  # one round (or no spread): nothing to show


def _status(s: Dict[str, Any]) -> str:
    if s["status"] == "ok":
        note = f"; {s['functional']}" if s.get("functional") else ""
        return "ok" + (f" ({s['rounds']} rounds)" if s.get("rounds", 1) > 1 else "") + note
    return f"{s['status']}: {s['reason']}"


def _cells(s: Dict[str, Any], accuracy: bool) -> List[str]:
    if "images_s" not in s:
        figures = ["-"] * (8 + accuracy)
    else:
        figures = [f"{s['images_s']:.1f}{_span(s['images_s_range'], '.1f')}",
                   f"{s['s_per_epoch']:.0f}" if s["s_per_epoch"] >= 10 else
                   f"{s['s_per_epoch']:.2f}",
                   f"{s['step_ms_median']:.0f} / {s['step_ms_p95']:.0f}",
                   _fmt(s["efficiency"], ".2f") + _span(s["efficiency_range"], ".2f"),
                   f"{s['peak_mb']:.0f}", f"{s['opt_state_mb']:.1f}", f"{s['held_mb']:.1f}",
                   f"{s.get('cpu_share', 0.0):.2f}"]
        figures += [_fmt(s.get("top1"), ".2f")] if accuracy else []
    return [f"`{s['row']}`", *figures, _status(s).replace("|", "/")]


def render_table(summaries: List[Dict[str, Any]], accuracy: bool = False) -> str:
    """The tutorials' table shape, one line per requested row, skipped and failed rows included.

    Example::

        print(render_table([summarize(r, base, 50_000) for r in records]))
    """
    head = ["row", "images/s (min-max)", "s/epoch", "step ms median / p95",
            "efficiency (min-max)", "peak MB/rank", "optim state MB/rank",
            "params+optim MB/rank", "CPU share"]
    head += ["top-1 %"] if accuracy else []
    head.append("status")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(s, accuracy)) + " |" for s in summaries]
    return "\n".join(lines) + "\n"


def _setup_line(env: Dict[str, Any]) -> str:
    return (f"{env['model']} on {env['data']}, per-rank batch {env['batch_per_rank']}, "
            f"{env['nproc']} processes x {env['threads_per_process']} thread(s) for the DDP rows, "
            f"{env['steps']} timed steps after {env['warmup']} warm-up, "
            f"{env.get('rounds_done', env['repeats'])} interleaved round(s), "
            f"epoch = {env['epoch_size']} samples; {env['cpu_model']} "
            f"({env['cores']} cores), torch {env['torch']}, backend {env['backend']}, "
            f"loader workers {env['loader_workers']}.")


_NOTES = """
Images/s is global (processes x per-rank batch / median step time); its median is over rounds and
the range in brackets is the min-max over rounds. Rows are interleaved within each round, each in
fresh processes. Efficiency = images/s / (processes x threads x `single-1t` images/s), computed per
round against the same round's `single-1t` and reported as the median (min-max). Peak MB is the
largest ru_maxrss (CPU) or max_memory_allocated (CUDA) of any rank. CPU share = CPU seconds per
wall second and thread of the ranks during the timed steps: below 1 a rank waited, for a peer or
for cores that other programs held. Raw step times and the full environment are in results.json.
"""


def write_outputs(out_dir: str, summaries: List[Dict[str, Any]], records: List[Dict[str, Any]],
                  env: Dict[str, Any], earlier: Sequence[str] = ()) -> List[str]:
    """Write results.md, results.json and (with matplotlib) chart.png; returns notes for the user.

    Example::

        write_outputs("bench-out", summaries, records, env)
    """
    os.makedirs(out_dir, exist_ok=True)
    title = f"ddpkit bench: {env['model']}, batch {env['batch_per_rank']}/rank, {env['cpu_model']}"
    notes = [] if _chart(os.path.join(out_dir, "chart.png"), summaries, title) else [
        "chart.png skipped: matplotlib is not installed (pip install 'ddpkit[plot]')"]
    accuracy = bool(env.get("accuracy"))
    md = [f"# ddpkit bench{' (accuracy mode)' if accuracy else ''}\n", _setup_line(env), "",
          render_table(summaries, accuracy), _NOTES.strip(), "", f"Command: `{env['command']}`"]
    md += [f"\nNote: {n}" for n in [*earlier, *notes]]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"environment": env, "summary": summaries, "rows": records,
                   "notes": [*earlier, *notes]}, f, indent=1)
    return notes


def _chart(path: str, summaries: List[Dict[str, Any]], title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [s for s in summaries if "images_s" in s]
    fig, ax = plt.subplots(figsize=(8, 0.45 * max(3, len(done)) + 1))
    names = [s["row"] for s in done]
    values = [s["images_s"] for s in done]
    errs = [[v - s["images_s_range"][0] for v, s in zip(values, done)],
            [s["images_s_range"][1] - v for v, s in zip(values, done)]]
    ax.barh(names, values, xerr=errs, color="#4c72b0", capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("global images/s (median, min-max over rounds)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
