"""The ``ddpkit`` command: one parser per subcommand (run, train, bench, slurm, k8s, ...), each a thin
layer over the library function that does the work.

User errors (:class:`~ddpkit.base.errors.DDPKitError`) print as one ``error:`` line and exit 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..base.interrupts import loading_the_command

with loading_the_command():  # torch loads here: a Ctrl-C meanwhile is one line, exit 130
    from ..base.errors import DDPKitError, JobSetupError
    from ..launchers.srun import is_first_task
    from . import bench, ckpt, doctor, k8s, plan, run, slurm, train, verify

__all__ = ["main", "entry", "status_of", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The full ``ddpkit`` argument parser.

    Example::

        build_parser().parse_args(["run", "--nproc", "2", "train.py"])
    """
    from ..version import __version__

    parser = argparse.ArgumentParser(
        prog="ddpkit", description="Data-parallel PyTorch training done right: run a script on N "
                                   "processes, train the built-in job, measure, render sbatch or Kubernetes YAML.")
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (run, train, verify, doctor, plan, slurm, k8s, bench, ckpt):
        command.add_parser(sub)
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
        if not isinstance(exc, JobSetupError) or is_first_task():  # the same in every task
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def status_of(argv: Optional[List[str]] = None) -> int:
    """:func:`main` with the way the executable ends folded in: a Ctrl-C while the flags are
    parsed is 130, argparse's ``--help`` 0 and its usage errors 2 (their line printed).

    Example::

        assert status_of(["plan", "--params", "-5", "--compute-ms", "10"]) == 2
    """
    try:
        return main(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling (parsing the flags)
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    except SystemExit as exc:  # argparse's --help / usage errors
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def entry() -> None:
    """The ``ddpkit`` executable: :func:`status_of`, then leave without interpreter finalisation.

    After torchrun's agent ran in this process (``ddpkit run``, ``ddpkit train``), tearing the
    interpreter down destroys its C++ rendezvous objects while their threads still run, which
    can abort the process ("terminate called without an active exception", SIGABRT) after the
    command already succeeded or printed its one error line. So: flush, run the atexit
    handlers (ddpkit's own shutdown among them), and exit with the command's status directly.

    Example::

        entry()   # what `ddpkit ...` and `python -m ddpkit ...` run
    """
    import atexit
    import os

    code = status_of()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
