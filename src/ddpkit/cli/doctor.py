"""``ddpkit doctor``: check this machine (and, under ``ddpkit run`` on every node, the job) and
measure its all-reduce links (``ddpkit.doctor``)."""
from __future__ import annotations

import argparse
import subprocess
import sys

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit doctor``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("doctor", help="check versions, backends, routes, clocks, the checkpoint "
                                      "directory, and measure all-reduce latency and bandwidth",
                       description="Runs the doctor on N local processes (ddpkit run -m "
                                   "ddpkit.doctor). On several nodes run `ddpkit run --nnodes "
                                   "... -m ddpkit.doctor` on each instead.")
    p.add_argument("--nproc", type=int, default=2, help="local processes (default 2; 1: no sweep)")
    p.add_argument("--output", help="the checkpoint directory to check")
    p.add_argument("--max-bytes", default="64M", help="largest all-reduce of the sweep (64M)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON (for ddpkit plan)")
    p.add_argument("--params", type=int, help="a model's parameter count: does its all-reduce fit "
                                              "the collective timeout?")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="the job's collective timeout (ddpkit train --timeout-s; default 600)")
    p.set_defaults(func=_cmd_doctor)


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from ..doctor.run import check_numbers, main, parse_size
    from ..base.errors import ConfigError

    if ns.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {ns.nproc}")
    parse_size(ns.max_bytes)  # refused here, before any process starts
    check_numbers(ns.params, ns.timeout_s)
    args = ["--max-bytes", ns.max_bytes, "--timeout-s", str(ns.timeout_s)] + \
        (["--output", ns.output] if ns.output else []) + \
        (["--json", ns.json] if ns.json else []) + \
        (["--params", str(ns.params)] if ns.params is not None else [])
    if ns.nproc == 1:
        return main(args)
    return subprocess.call([sys.executable, "-m", "ddpkit", "run", "--nproc", str(ns.nproc),
                            "-m", "ddpkit.doctor", *args])
