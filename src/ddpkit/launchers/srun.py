"""``ddpkit run`` as a task of an ``srun`` step: one launcher per node, on as many nodes as asked.

A wrong layout (``--ntasks-per-node=2`` around ``srun ddpkit run``, or ``--nnodes`` that is not
the step's) would start twice the workers, or wait for nodes that never come; every task stops
at once instead, and task 0 says why (:class:`~ddpkit.base.errors.JobSetupError`).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from ..base.errors import ConfigError, JobSetupError
from ..env.slurm import expand_nodelist, parse_tasks_per_node, step_id, step_tasks_per_node

__all__ = ["step_task", "check_layout", "is_first_task"]


def step_task(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """This process's task number in the srun step it belongs to, or None outside one (the
    batch script itself, a login shell, torchrun's workers).

    Example::

        step_task({"SLURM_PROCID": "3", "SLURM_STEP_ID": "0"})   # 3
    """
    if "RANK" in environ or step_id(environ) is None:
        return None
    try:
        return int(environ["SLURM_PROCID"])
    except (KeyError, ValueError):
        return None


def is_first_task(environ: Mapping[str, str] = os.environ) -> bool:
    """False only in tasks 1, 2, ... of an srun step (they leave the report to task 0).

    Example::

        if is_first_task():
            print("error: ...")
    """
    return step_task(environ) in (None, 0)


def check_layout(nnodes: Optional[int], nproc: int,
                 environ: Mapping[str, str] = os.environ) -> None:
    """Under srun: raise :class:`JobSetupError` unless this is the only task on its node and the
    step spans ``nnodes`` nodes (None: any number, an elastic range). Outside an srun step:
    nothing to check.

    Example::

        check_layout(cfg.nnodes, nproc)   # in `ddpkit run`, before the agent starts
    """
    if step_task(environ) is None:
        return
    raw = step_tasks_per_node(environ) or "1"
    counts = parse_tasks_per_node(raw)
    # Decided from the whole step, so every task reaches the same verdict (none is left waiting
    # at the rendezvous for a task that stopped).
    crowded = next((i for i, n in enumerate(counts) if n > 1), None)
    if crowded is not None:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        try:
            name = expand_nodelist(nodelist)[crowded] if nodelist else f"node {crowded}"
        except (ConfigError, IndexError):
            name = f"node {crowded}"
        raise JobSetupError(
            f"srun started {counts[crowded]} tasks on {name} (tasks per node: {raw}), and each "
            f"`ddpkit run` would start --nproc {nproc} worker(s) and join as a node of its own: "
            "run one `ddpkit run` per node (#SBATCH --ntasks-per-node=1, as `ddpkit slurm` "
            "renders; it starts the workers), or drop `ddpkit run` and start one task per device "
            "with `srun python train.py`")
    nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or len(counts))
    if nnodes is not None and nnodes != nodes:
        raise JobSetupError(f"ddpkit run --nnodes {nnodes}, but this srun step runs on {nodes} "
                            f"node(s): pass --nnodes \"$SLURM_NNODES\" (or ask Slurm for "
                            f"--nodes={nnodes})")
