"""A node's launcher answers for its stopped workers: a rank stopped (SIGSTOP, a debugger, a
process frozen in native code) cannot say where it is, and when it is alone on its node no other
rank there can read its stack. ``ddpkit run`` on several nodes keeps a thread that reads, with
py-spy, the stack of any of its own workers a reporting rank on another node asks for
(:func:`ddpkit.faults.stall.answer_stack_asks`), through the job's store: the workers'
``MASTER_ADDR`` and ``MASTER_PORT``, under the watch's prefix for their run and attempt.
"""
from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..faults import stall
from ..faults.watch_store import store_prefix
from ..faults.nativelog import quiet_native_warnings
from . import watchdog

__all__ = ["StackAnswers", "worker_environments"]


def worker_environments(parent: Optional[int] = None) -> Dict[int, Dict[str, str]]:
    """The environment of each child of ``parent`` (this process) that is a rank of a job:
    pid -> variables, for those with ``RANK`` and ``MASTER_ADDR`` (not a DataLoader worker).

    Example::

        worker_environments()   # {4242: {'RANK': '2', 'MASTER_ADDR': '10.0.0.1', ...}}
    """
    found = {}
    if parent is None:  # the agent's own record: forked workers' /proc environ is the server's
        found = {pid: env for pid, env in watchdog.started_workers().items()
                 if "RANK" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env}
        if found:
            return found
    for pid in watchdog.children(parent):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        env = dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
        if "RANK" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env:
            found[pid] = env
    return found


class StackAnswers:
    """While the agent runs (a context): every ``interval`` seconds, the asks for the stack of
    one of this process's workers are answered with ``read`` (py-spy), well within the 3 s the
    asking rank waits.

    Example::

        with StackAnswers():
            torchrun(...)
    """

    def __init__(self, interval: float = 0.5,
                 read: Optional[Callable[[int], Optional[List[str]]]] = None) -> None:
        self.interval = interval
        self._read = read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpkit-stack-answers",
                                        daemon=True)

    def __enter__(self) -> "StackAnswers":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        where: Optional[Tuple[str, int, str]] = None
        store, seen, host = None, 0, socket.gethostname()
        workers: Dict[int, Dict[str, str]] = {}
        while not self._stop.wait(self.interval):
            try:
                # /proc is read again only when a worker is gone (a restart): not twice a
                # second in every launcher of a busy machine
                if not workers or not all(os.path.exists(f"/proc/{pid}") for pid in workers) \
                        or len(workers) < _local_world(workers):  # some still starting
                    workers = worker_environments()
                if not workers:
                    continue
                env = next(iter(workers.values()))
                now = (env["MASTER_ADDR"], int(env["MASTER_PORT"]), store_prefix(env))
                if now != where and not _listening(now[0], now[1]):  # a new attempt of the
                    continue  # job (a restart) whose rank 0 has not opened its store yet
                # torch's client prints its native stack for a store gone with its rank (or
                # gone between the look and the connect) before it raises: next time
                with quiet_native_warnings():
                    if now != where:
                        store, seen, where = _connect(*now), 0, now
                    seen = stall.answer_stack_asks(store, host, seen,
                                                   int(env.get("WORLD_SIZE", 1)),
                                                   self._read or _py_spy, mine=set(workers))
            except Exception:  # noqa: BLE001 - the store not up yet, or gone: next time
                where = None


def _local_world(workers: Dict[int, Dict[str, str]]) -> int:
    env = next(iter(workers.values()))
    try:
        return int(env.get("LOCAL_WORLD_SIZE", len(workers)))
    except ValueError:
        return len(workers)


def _listening(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _connect(addr: str, port: int, prefix: str) -> Any:
    import torch.distributed as dist

    client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=5))
    return dist.PrefixStore(prefix, client)


def _py_spy(pid: int) -> Optional[List[str]]:
    from ..faults.hangs import python_stack

    return python_stack(pid)

