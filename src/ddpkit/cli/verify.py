"""``ddpkit verify``: run a script on 1 and on N processes and say whether they compute the same,
and if not, where and why (``ddpkit.verify``).
"""
from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit verify``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("verify", help="check that a script computes the same on N processes "
                                      "as on 1, and name the cause when it does not",
                       description="Runs SCRIPT unchanged on 1 process (three times: again, and "
                                   "with its batches reversed, which measures the tolerance) "
                                   "and on N, records every optimizer step through "
                                   "ddpkit.setup(), and compares them step by step.")
    p.add_argument("--nproc", type=int, default=2, help="processes to compare with 1 (default 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps to compare (default 10, or the script's first epoch "
                        "when it is shorter)")
    p.add_argument("--accum-steps", type=int, default=None, metavar="K",
                   help="on 1 process, accumulate K micro-batches per step, the batches of K "
                        "ranks (K = N: the same micro-batch as on N; for scripts that step on "
                        "every batch). Default: N for a model with BatchNorm layers that are "
                        "not synced, when its batch splits so, else 1")
    p.add_argument("--eval-within", type=int, default=200, metavar="E",
                   help="after the compared steps, train on for up to E more to reach the "
                        "script's first evaluation and compare what it evaluated and printed "
                        "(default 200; 0: do not)")
    p.add_argument("--timeout", type=float, default=900, metavar="S",
                   help="stop a run (and its ranks) still going after S s (default 900)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--backend", default=None,
                   help="the script's process group backend (gloo: N processes share a GPU)")
    p.add_argument("script", nargs="?", help="the script (it calls ddpkit.setup())")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(ns: argparse.Namespace) -> int:
    from ..base.errors import ConfigError
    from ..verify import verify
    from ..verify.report import as_json, summary, table
    from .flags import pass_backend

    if not ns.script:
        raise ConfigError("a script is required: ddpkit verify [--nproc N] [--steps S] "
                          "[--accum-steps K] SCRIPT [ARGS...]")
    _check_script(ns.script)
    pass_backend(ns.backend)
    if ns.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {ns.timeout:g}")
    verdict = verify(ns.script, ns.script_args, ns.nproc, ns.steps, timeout=ns.timeout,
                     accum=ns.accum_steps, eval_within=ns.eval_within)
    if verdict.steps:  # none when a run failed or hung before any step compared
        print(table(verdict, ns.nproc))
    print(summary(verdict, ns.nproc, ns.script, ns.accum_steps or 1), flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(as_json(verdict, ns.nproc, ns.script, ns.script_args, ns.accum_steps or 1)
                    + "\n")
    return 0 if verdict.passed else 1


def _check_script(script: str) -> None:
    import os

    from ..base.errors import ConfigError

    if not os.path.exists(script):
        raise ConfigError(f"script {script!r} does not exist")
    if os.path.isdir(script):
        raise ConfigError(f"script {script!r} is a directory; give the Python file to verify")
