"""``ddpkit bench``: the tutorials' DP / DDP / AMP / Horovod table, with ZeRO and FSDP rows,
measured here, honestly.

Each row runs in fresh worker processes (:mod:`.worker`); rows are interleaved round by round so
drift is shared (:mod:`.run`); rows and what can run here in :mod:`.rows`; figures, tables and
the chart in :mod:`.report`; the machine in :mod:`.environment`.

Example::

    from ddpkit.bench import BenchConfig, run_bench
    print(run_bench(BenchConfig(rows=["single-1t", "ddp"], quick=True))["table"])
"""
from .rows import ROWS, BenchConfig, Row, parse_rows, plan_row, skip_reason
from .run import run_bench

__all__ = ["ROWS", "BenchConfig", "Row", "parse_rows", "plan_row", "skip_reason", "run_bench"]
