"""``ddpkit.launch``: run a Python function on N local processes (``torch.multiprocessing``),
each with torchrun-style variables so ``ddpkit.setup()`` inside it just works.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import tempfile
import time
from typing import Any, Callable, Dict, Optional

import torch.multiprocessing as mp

from ..faults.crash import is_peer_failure
from ..env.dist import shutdown
from ..env.detect import spawn_env, to_environ
from ..base.errors import ConfigError
from . import forked
from .network import free_port

__all__ = ["launch", "LaunchError"]


class LaunchError(RuntimeError):
    """A worker failed; the message names the rank and carries its traceback.

    Example::

        try:
            ddpkit.launch(train, 2)
        except LaunchError as exc:
            print(exc)   # rank 1 failed: ...
    """


def _spawned(index: int, fn: Callable[..., Any], args: tuple, nprocs: int, port: int,
             result_dir: str, environ: Dict[str, str]) -> None:
    # The caller's environment as it is now (a forkserver child would otherwise see the
    # server's, from when it started), then this rank's place in the job.
    if hasattr(signal, "pthread_sigmask"):  # the server's shield (forked.SHIELDED) is not ours
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forked.SHIELDED)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(to_environ(spawn_env(index, nprocs, "127.0.0.1", port)))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    try:
        result = fn(*args)
        if index == 0:
            with open(os.path.join(result_dir, "result.pkl"), "wb") as f:
                pickle.dump(result, f)
    except Exception as exc:
        if is_peer_failure(exc):
            time.sleep(5)  # let the rank that failed first be the one reported (we get stopped)
        raise
    finally:
        shutdown()


#: What the ``forkserver`` preloads once, so that every launch after the first starts its ranks in
#: a fraction of a second instead of importing torch in each (about 3 s per process on 2 cores):
#: the server ``ddpkit run`` and ``ddpkit verify`` fork their workers from (:mod:`.forked`).
PRELOAD = forked.PRELOAD


def _context(start_method: str) -> None:
    if start_method == "forkserver":
        forked.start_server()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: Optional[float] = None,
           start_method: str = "forkserver") -> Any:
    """Run ``fn(*args)`` on ``nprocs`` local processes and return rank 0's result.

    Each process sees torchrun-style variables, so ``ddpkit.setup()`` inside ``fn`` just works.
    When one rank fails the others are stopped and its traceback is raised here; past
    ``timeout`` seconds every rank is stopped and :class:`TimeoutError` raised (no hang).
    ``fn`` must be importable (defined in a module) with the default ``forkserver`` start
    method (a server started once, with torch and ddpkit imported, forks each rank: a launch
    after the first costs no imports) and with ``spawn``; in a notebook pass
    ``start_method="fork"``. Ranks see the caller's environment as it is at the call.

    Example::

        def train(lr):
            rt = ddpkit.setup()
            ...
            return final_accuracy

        acc = ddpkit.launch(train, 2, 0.1)
    """
    if nprocs < 1:
        raise ConfigError(f"nprocs must be >= 1, got {nprocs}")
    result_dir = tempfile.mkdtemp(prefix="ddpkit-launch-")
    try:
        _context(start_method)
        ctx = mp.start_processes(_spawned, args=(fn, args, nprocs, free_port(), result_dir,
                                                 dict(os.environ)),
                                 nprocs=nprocs, join=False, start_method=start_method)
        _join(ctx, timeout)
        with open(os.path.join(result_dir, "result.pkl"), "rb") as f:
            return pickle.load(f)
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)


def _join(ctx: Any, timeout: Optional[float]) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.2):
            if deadline is not None and time.monotonic() > deadline:
                _terminate(ctx)
                raise TimeoutError(f"ranks still running after {timeout:.0f} s; all stopped")
    except mp.ProcessRaisedException as exc:
        raise LaunchError(f"rank {exc.error_index} failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise LaunchError(f"rank {exc.error_index} exited with code {exc.exit_code}") from None


def _terminate(ctx: Any) -> None:
    for proc in ctx.processes:
        with contextlib.suppress(Exception):
            if proc.is_alive():
                proc.kill()
    for proc in ctx.processes:
        proc.join(5)
