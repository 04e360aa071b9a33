"""``ddpkit slurm``: print an sbatch script that runs a script with ``ddpkit run`` on N nodes."""
from __future__ import annotations

import argparse

from ..launchers.sbatch import DEFAULT_REQUEUE_GRACE, render_sbatch
from .flags import add_launch_flags

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit slurm``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("slurm", help="print an sbatch script for N nodes x G GPUs",
                       description="Render an sbatch script that runs SCRIPT with ddpkit run "
                                   "(srun + torchrun c10d rendezvous) on every node.")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--min-nodes", type=int, default=None, metavar="MIN",
                   help="elastic: go on while at least MIN of the nodes remain (#SBATCH "
                        "--no-kill, ddpkit run --nnodes MIN:$SLURM_NNODES)")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="each process a replica: a lost node is left behind while the others "
                        "keep training, and heals from them when it is back (ddpkit run "
                        "--fault-tolerant; with --min-nodes, steps commit while that many "
                        "nodes are alive)")
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--job-name", default="ddpkit")
    p.add_argument("--time", default="01:00:00")
    p.add_argument("--partition")
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument("--port", type=int, default=None,
                   help="rendezvous port on the first node (default: one per job, "
                        "15000 + job id %% 20000, so jobs sharing a node do not collide)")
    add_launch_flags(p, only=["rdzv_timeout", "max_restarts"])  # passed to every node's run
    p.add_argument("--requeue-grace", type=int, default=DEFAULT_REQUEUE_GRACE, metavar="SECONDS",
                   help="Slurm sends SIGUSR1 this long before the time limit or a preemption: "
                        "every rank saves a checkpoint and the job requeues itself (default "
                        f"{DEFAULT_REQUEUE_GRACE})")
    p.add_argument("--no-requeue", dest="requeue_grace", action="store_const", const=None,
                   help="no SIGUSR1, no requeue")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_slurm)


def _cmd_slurm(ns: argparse.Namespace) -> int:
    print(render_sbatch(ns.nodes, ns.gpus_per_node, ns.script, ns.script_args,
                        job_name=ns.job_name, time=ns.time, partition=ns.partition,
                        cpus_per_task=ns.cpus_per_task, port=ns.port,
                        rdzv_timeout=ns.rdzv_timeout, max_restarts=ns.max_restarts or 0,
                        requeue_grace=ns.requeue_grace, min_nodes=ns.min_nodes,
                        fault_tolerant=ns.fault_tolerant), end="")
    return 0
