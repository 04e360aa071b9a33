"""``ddpkit run``: launch a script on N processes per node (torchrun's elastic agent underneath)."""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from .flags import (add_launch_flags, add_stall_flag, pass_backend, pass_stall_after,
                    pass_timeout, run_config)

__all__ = ["add_parser"]



def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit run``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("run", help="launch a script on N processes (torchrun underneath)",
                       description="Launch SCRIPT on --nproc processes per node with torchrun's "
                                   "elastic agent. On one node a free port is picked.")
    p.add_argument("--nproc", default=None,
                   help="processes per node, or 'auto' (default 1, or a pod's PET_NPROC_PER_NODE)")
    p.add_argument("--backend", default=None,
                   help="process group backend of the script's ddpkit.setup() (default: nccl on "
                        "GPUs, gloo on CPUs; gloo lets several processes share one GPU)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds a collective waits for every rank before the stuck one is "
                        "named and the job stops (default 600; the script's "
                        "ddpkit.setup(timeout=) wins)")
    add_stall_flag(p)
    add_launch_flags(p)
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("script", nargs="?", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_cmd_run)


def _cmd_run(ns: argparse.Namespace) -> int:
    from ..base.errors import ConfigError
    from ..launchers.torchrun import run

    if not ns.script:
        raise ConfigError("a script is required: ddpkit run [--nproc N] SCRIPT [ARGS...]")

    pass_backend(ns.backend)
    pass_timeout(ns.timeout)
    pass_stall_after(ns.stall_after)
    cfg = run_config(ns, ns.script, ns.script_args, nproc=ns.nproc, module=ns.module)
    return run(dataclasses.replace(cfg, on_give_up=_run_again))


def _run_again() -> str:
    """How a script resumes once ``--max-restarts`` are used up: this very command again."""
    command = shlex.join(["ddpkit", *sys.argv[1:]])
    return ("; a script that keeps checkpoints (rt.checkpointer(..., resume=\"auto\")) resumes "
            f"from its latest when you run the same command again: `{command}`")
