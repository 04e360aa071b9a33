"""``ddpkit bench``: its flags, over the mode's defaults, then :func:`ddpkit.bench.run_bench`."""
from __future__ import annotations

import argparse
import os

from ..bench.rows import DEFAULT_ROWS, QUICK_ROWS, ROWS, BenchConfig, parse_rows

__all__ = ["add_parser", "config_from_args"]


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
    p.add_argument("--per-rank-batch", "--batch", dest="batch", type=int, default=64,
                   help="a process's batch per optimizer step (default 64; a GPU's in the dp "
                        "row): the global batch is it x the processes, as results.json's "
                        "global_batch says; --batch is the older spelling")
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
    from ..job.datasets import build_dataset
    return len(build_dataset("digits", train=True))


def _cmd_bench(ns: argparse.Namespace) -> int:
    from ..bench.run import run_bench

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
