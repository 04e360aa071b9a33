"""Run ``argv`` under ``horovodrun`` on this host: how ``ddpkit train --engine horovod`` starts
its workers (gloo controller, loopback, one line naming the failed rank).
"""
from __future__ import annotations

import os
import sys
from typing import List

from ..engines.horovod import missing_reason
from ..base.errors import ConfigError

__all__ = ["launch_args", "run"]


def launch_args(nproc: int, argv: List[str], start_timeout: int = 60) -> List[str]:
    """``horovodrun`` arguments (gloo controller, this host) that run ``argv`` on ``nproc`` ranks.

    Example::

        launch_args(2, ["python", "-m", "ddpkit.job.train", "cfg.json"])
    """
    return ["-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo",
            "--start-timeout", str(start_timeout), *argv]


def run(nproc: int, argv: List[str], start_timeout: int = 60) -> int:
    """Run ``argv`` under ``horovodrun`` on this host; returns 0, or 1 with one error line.

    Horovod's launcher relays every rank's output prefixed ``[rank]``; its own traceback on a
    failed rank is replaced by one line naming that rank.

    Example::

        run(2, [sys.executable, "-m", "ddpkit.job.train", "runs/x/config.json"])
    """
    reason = missing_reason()
    if reason:
        raise ConfigError(reason)
    from horovod.runner.launch import _run, parse_args

    os.environ.setdefault("HOROVOD_GLOO_IFACE", "lo")  # one host: loopback, never the LAN
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    saved = sys.argv
    sys.argv = ["horovodrun", *launch_args(nproc, argv, start_timeout)]
    try:
        _run(parse_args())
    except RuntimeError as exc:
        text = " ".join(str(exc).split())
        first = text.split("The first process to do so was:")[-1].strip()
        print(f"error: the Horovod job failed ({first or text}); its output is above",
              file=sys.stderr, flush=True)
        return 1
    finally:
        sys.argv = saved
    return 0
