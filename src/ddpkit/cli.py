"""The ``ddpkit`` command: a thin argparse layer over the library (run, train, bench, slurm).

User errors (:class:`~ddpkit.errors.DDPKitError`) print as one ``error:`` line and exit 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .errors import DDPKitError

__all__ = ["main", "build_parser"]


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="launch a script on N processes (torchrun underneath)",
                       description="Launch SCRIPT on --nproc processes per node with torchrun's "
                                   "elastic agent. On one node a free port is picked.")
    p.add_argument("--nproc", default="1", help="processes per node, or 'auto' (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (static rendezvous)")
    p.add_argument("--master-addr", help="address of node 0 (static rendezvous)")
    p.add_argument("--master-port", type=int, help="port on node 0 (default: a free one)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (multi-node, elastic)")
    p.add_argument("--rdzv-id", help="job id shared by all nodes (default 'ddpkit')")
    p.add_argument("--rdzv-timeout", type=float, metavar="SECONDS",
                   help="several nodes: every node must join within this many seconds of the "
                        "first (default: torchrun's 600)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole group this many times when a worker dies")
    p.add_argument("--iface", help="network interface for gloo/nccl traffic (e.g. eth1)")
    p.add_argument("--log-dir", help="directory for per-rank logs (torchrun --log-dir)")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("-v", "--verbose", action="store_true", help="show torchrun's agent logs")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_cmd_run)


def _cmd_run(ns: argparse.Namespace) -> int:
    from .launchers import RunConfig, run

    cfg = RunConfig(script=ns.script, script_args=ns.script_args, nproc=ns.nproc,
                    nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                    master_port=ns.master_port, rdzv_endpoint=ns.rdzv_endpoint,
                    rdzv_id=ns.rdzv_id, rdzv_timeout=ns.rdzv_timeout,
                    max_restarts=ns.max_restarts, module=ns.module,
                    iface=ns.iface, log_dir=ns.log_dir, verbose=ns.verbose)
    return run(cfg)


def _add_slurm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="print an sbatch script for N nodes x G GPUs",
                       description="Render an sbatch script that runs SCRIPT with ddpkit run "
                                   "(srun + torchrun c10d rendezvous) on every node.")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--job-name", default="ddpkit")
    p.add_argument("--time", default="01:00:00")
    p.add_argument("--partition")
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_slurm)


def _cmd_slurm(ns: argparse.Namespace) -> int:
    from .slurm import render_sbatch

    print(render_sbatch(ns.nodes, ns.gpus_per_node, ns.script, ns.script_args,
                        job_name=ns.job_name, time=ns.time, partition=ns.partition,
                        cpus_per_task=ns.cpus_per_task, port=ns.port), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full ``ddpkit`` argument parser.

    Example::

        build_parser().parse_args(["run", "--nproc", "2", "train.py"])
    """
    from . import __version__

    parser = argparse.ArgumentParser(prog="ddpkit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from . import train_cli
    from .bench import add_parser as _add_bench

    for add in (_add_run, train_cli.add_parser, _add_slurm, _add_bench):
        add(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``ddpkit`` command; returns the exit status.

    Example::

        sys.exit(main(["run", "--nproc", "2", "examples/train_ddpkit.py"]))
    """
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except DDPKitError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
