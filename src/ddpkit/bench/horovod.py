"""The ``horovod`` row of ``ddpkit bench``: the same timed steps as every row, on Horovod.

``horovod.runner.run`` starts fresh processes with Horovod's environment; in them
:func:`ddpkit.setup` selects the Horovod engine, so :func:`ddpkit.bench.worker.run_row` measures
Horovod's ``DistributedOptimizer`` (gloo all-reduce) with the same model, data and timing code.
Only imported when ``horovod.torch`` imports.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict

__all__ = ["launch_horovod"]


def launch_horovod(plan: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Run :func:`ddpkit.bench.worker.run_row` on ``plan['nprocs']`` local Horovod processes.

    Example::

        launch_horovod(plan_row(ROWS["horovod"], cfg, caps), timeout=600)
    """
    from horovod.runner import run

    from .worker import run_row

    os.environ.setdefault("HOROVOD_GLOO_IFACE", "lo")  # one host: loopback only
    outs = run(run_row, args=(plan["job"],), num_proc=plan["nprocs"], use_gloo=True,
               start_timeout=int(timeout), executable=sys.executable)
    return outs[0]
