"""Watchdogs around torchrun's agent: a node whose workers are gone but whose agent is stuck on
the store exits, a node started with another ``--nnodes`` stops at once, and a stopped worker
does not hold the end of a job for torchrun's 30 s shutdown grace, and ddpkit's own workers
hold a Ctrl-C that comes while their interpreter starts until they can end quietly.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from ..faults.stops import proc_stat
from . import forked
from .network import split_endpoint

__all__ = ["children", "stop_lost_workers", "kill_stopped", "ending_stopped_workers",
           "holding_early_interrupts", "AgentWatchdog", "watch_nnodes", "workers",
           "started_workers", "workers_or_children"]


def _stat(pid: str) -> Optional[Tuple[int, str]]:
    """(parent pid, state letter) of ``pid`` from /proc, or None if it is gone."""
    fields = proc_stat(pid)
    return None if fields is None else (int(fields[1]), fields[0])


def children(pid: Optional[int] = None) -> Dict[int, str]:
    """Child pid -> state letter (``R``, ``S``, ``Z`` for exited-but-not-reaped...) on Linux;
    of this process (``pid`` None): not its fork server and resource tracker
    (:func:`.forked.helpers`), which start before the workers and outlive them.

    Example::

        children()   # {4242: 'S'}
    """
    parent = os.getpid() if pid is None else pid
    skip = forked.helpers() if pid is None else set()
    found: Dict[int, str] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        info = _stat(entry) if entry.isdigit() else None
        if info is not None and info[0] == parent and int(entry) not in skip:
            found[int(entry)] = info[1]
    return found


def stop_lost_workers(known: Iterable[int], grace: float = 5.0,
                      list_children: Callable[[], Dict[int, str]] = children,
                      servers: Iterable[Optional[int]] = ()) -> List[int]:
    """Kill this process's running children that are not in ``known``, with their process
    groups, and reap them, and every child of the fork ``servers`` (:mod:`.forked`: the
    workers forked for this process); return the pids of this process's children killed.

    A stop signal that reaches torchrun's agent while it starts the workers interrupts
    ``start_processes`` before the agent has recorded them: its shutdown then closes nothing,
    and the workers started so far (each in its own session, so a terminal's Ctrl-C misses
    them too) run on, holding the job's output open. ``ddpkit run`` calls this after a stop
    with the children it had before it started the agent.

    Example::

        before = set(children())
        ...   # a stop signal interrupted the agent
        stop_lost_workers(before)   # [4242]
    """
    known = set(known)
    lost = sorted(pid for pid, state in list_children().items()
                  if pid not in known and state not in "ZX")
    for server in filter(None, servers):
        _end_server(server)
    for pid in lost:
        _kill_group(pid)
    deadline = time.monotonic() + grace
    waiting = set(lost)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    waiting.discard(pid)
            except ChildProcessError:
                waiting.discard(pid)
        time.sleep(0.02 if waiting else 0)
    return lost


def _end_server(server: int) -> None:
    """SIGKILL a fork server (this process's child) and every worker it forked: stopped first,
    so that a worker it was forking at the stop is among its children (else that one would
    start after this process had gone, and die printing multiprocessing's traceback)."""
    try:
        os.kill(server, signal.SIGSTOP)
    except OSError:
        return
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and (proc_stat(server) or "T")[0] not in "TtZX":
        time.sleep(0.005)
    killed = children(server)
    for forked in killed:
        _kill_group(forked)
    while time.monotonic() < deadline + 5.0 and any(  # dead (zombies of the stopped server)
            (proc_stat(pid) or "Z")[0] not in "ZX" for pid in killed):
        time.sleep(0.005)
    with contextlib.suppress(OSError):
        os.kill(server, signal.SIGKILL)
        os.waitpid(server, 0)


def _kill_group(pid: int) -> None:
    """SIGKILL ``pid`` with its process group when it leads one of its own (a worker: its
    DataLoader workers go with it), else alone."""
    try:
        if os.getpgid(pid) == pid != os.getpgrp():
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def workers(context: Any) -> Dict[int, Tuple[int, Optional[int]]]:
    """The workers of torchrun's process context (``agent._pcontext``): local rank -> (pid,
    exit code, None while running; a negative one: killed by that signal), whether they were
    started as fresh interpreters or forked (:mod:`.forked`). In the agent's thread only (it
    reaps them).

    Example::

        workers(agent._pcontext)   # {0: (4242, None), 1: (4243, 0)}
    """
    handlers = getattr(context, "subprocess_handlers", None)
    if handlers:
        return {rank: (h.proc.pid, h.proc.poll()) for rank, h in handlers.items()}
    processes = getattr(getattr(context, "_pc", None), "processes", None) or []
    return {rank: (p.pid, p.exitcode) for rank, p in enumerate(processes) if p.pid is not None}


def kill_stopped(pids: Dict[int, int],
                 say: Optional[Callable[[str], Any]] = None) -> List[int]:
    """SIGKILL the workers of ``pids`` (local rank -> pid) that are stopped (SIGSTOP, a
    debugger): a stopped process acts on no other signal. Returns the pids killed, each said in
    one line.

    Example::

        kill_stopped({0: 4242, 1: 4243})   # [4243] if 4243 was stopped
    """
    killed = []
    for local_rank, pid in sorted(pids.items()):
        fields = proc_stat(pid)
        if fields is not None and fields[0] in ("T", "t"):
            _kill_group(pid)
            killed.append(pid)
            (say or sys.stderr.write)(
                f"ddpkit run: local rank {local_rank} (pid {pid}) was stopped (SIGSTOP or a "
                "debugger) and could not act on the stop: killed it\n")
    return killed


@contextlib.contextmanager
def ending_stopped_workers() -> Iterator[None]:
    """While the agent runs: when it ends its workers (a failure, a restart, a stop signal),
    the stopped ones are killed at once (a worker leads its own session: a terminal's Ctrl-Z
    stops only the launcher, so a stopped worker was stopped on purpose). torchrun sends them
    its stop signal and waits 30 s for them to exit before it kills them; a stopped process
    never acts on the signal, so a job whose rank 0 failed beside a stopped rank 1 took 30 s
    longer to end.

    Example::

        with ending_stopped_workers():
            torchrun(args)
    """
    try:
        from torch.distributed.elastic.multiprocessing.api import PContext
        close = PContext.close
    except (ImportError, AttributeError):  # another torch: its own shutdown, unchanged
        yield
        return

    def closing(context: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):  # never in the way of the shutdown itself
            # only workers not yet reaped: a reaped one's pid may belong to another process now
            kill_stopped({rank: pid for rank, (pid, code) in workers(context).items()
                          if code is None})
        try:
            return close(context, *args, **kwargs)
        finally:  # its workers are gone and reaped: none is the agent's now
            if _STARTED and _STARTED[0] is context:
                _STARTED.clear()

    start = PContext.start

    def starting(context: Any, *args: Any, **kwargs: Any) -> Any:
        _STARTED[:] = [context]
        if getattr(context, "subprocess_handlers", None) is None and \
                isinstance(getattr(context, "envs", None), dict):
            # forked workers: torch sets only the agent's variables over the fork server's
            # environment (as it was when the server started); a fresh interpreter gets the
            # launcher's environment as it is now under them, and so do they
            for rank, env in list(context.envs.items()):
                context.envs[rank] = {**os.environ, **env}
        started = start(context, *args, **kwargs)
        with contextlib.suppress(Exception):
            _ending_stopped_forked(context)
        return started

    try:
        from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
        poll = MultiprocessContext._poll
    except (ImportError, AttributeError):
        MultiprocessContext, poll = None, None

    def polled(context: Any) -> Any:
        result = poll(context)
        with contextlib.suppress(Exception):
            if result is None and _all_exited_with_0(context):
                result = poll(context)  # now done
            _every_failure(context, result)
        return result

    PContext.close, PContext.start = closing, starting
    if MultiprocessContext is not None:
        MultiprocessContext._poll = polled
    try:
        yield
    finally:
        PContext.close, PContext.start = close, start
        if MultiprocessContext is not None:
            MultiprocessContext._poll = poll
        _STARTED.clear()


def _all_exited_with_0(context: Any) -> bool:
    """Forked workers: torch's process context counts a worker done when it returned a value;
    one that ended by ``os._exit(0)`` (exit code 0, as torchrun counts a success for a fresh
    interpreter) returned none, and the agent would wait for it forever. When every worker has
    exited with 0, the missing values are recorded (None) and the workers are done."""
    processes = context._pc.processes
    if not processes or any(p.exitcode != 0 for p in processes):
        return False
    for rank in range(len(processes)):
        context._return_values.setdefault(rank, None)
    return True


def _every_failure(context: Any, result: Any) -> None:
    """Forked workers: torch's process context reports the first rank it found failed and ends
    the rest; the others that had failed by then are added, as for fresh interpreters (the rank
    that raised is then named, not the peer that exited first having lost it)."""
    if result is None or not getattr(result, "failures", None):
        return
    from torch.distributed.elastic.multiprocessing.api import ProcessFailure

    for rank, process in enumerate(context._pc.processes):
        if rank not in result.failures and process.exitcode not in (None, 0):
            result.failures[rank] = ProcessFailure(local_rank=rank, pid=process.pid,
                                                   exitcode=process.exitcode,
                                                   error_file=context.error_files[rank])


def _ending_stopped_forked(context: Any) -> None:
    """Forked workers (:mod:`.forked`): torch's process context ends the others itself once one
    has failed (SIGTERM, then 30 s before SIGKILL); the stopped ones are killed first."""
    processes = getattr(getattr(context, "_pc", None), "processes", None)
    if not processes:
        return
    pc = context._pc
    join = pc.join

    def joining(*args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            if any(p.exitcode not in (None, 0) for p in processes):
                kill_stopped({rank: p.pid for rank, p in enumerate(processes)
                              if p.exitcode is None})
        return join(*args, **kwargs)

    pc.join = joining


_STARTED: List[Any] = []  # the process context the agent started last (ending_stopped_workers)


def started_workers() -> Dict[int, Dict[str, str]]:
    """While the agent runs (inside :func:`ending_stopped_workers`): the workers it started
    last that are still running, pid -> the variables it gave each (``RANK``, ``MASTER_ADDR``,
    ...), whether they are fresh interpreters or forked (whose ``/proc/PID/environ`` is the
    fork server's).

    Example::

        started_workers()   # {4242: {'RANK': '0', 'MASTER_ADDR': '10.0.0.1', ...}}
    """
    if not _STARTED:
        return {}
    context = _STARTED[0]
    envs = getattr(context, "envs", None) or {}
    found = {}
    for rank, pid in _pids(context).items():
        fields = proc_stat(pid)
        if fields is not None and fields[0] not in "ZX":
            found[pid] = dict(envs.get(rank, {}))
    return found


def _pids(context: Any) -> Dict[int, int]:
    # not Process.exitcode: it reaps, and the callers run beside the agent's own thread
    handlers = getattr(context, "subprocess_handlers", None)
    if handlers:
        return {rank: h.proc.pid for rank, h in handlers.items()}
    processes = getattr(getattr(context, "_pc", None), "processes", None) or []
    return {rank: p.pid for rank, p in enumerate(processes) if p.pid is not None}


def workers_or_children() -> Dict[int, str]:
    """The agent's workers, pid -> state letter (``X``: gone), where they were forked (a fork
    server's children, reaped by it); else this process's children (:func:`children`).

    Example::

        workers_or_children()   # {4242: 'S', 4243: 'X'}
    """
    context = _STARTED[0] if _STARTED else None
    if context is None or getattr(context, "subprocess_handlers", None):
        return children()
    states = {}
    for pid in _pids(context).values():
        fields = proc_stat(pid)
        states[pid] = "X" if fields is None else fields[0]
    return states


@contextlib.contextmanager
def holding_early_interrupts(active: bool = True) -> Iterator[None]:
    """While the agent runs: its workers start with SIGINT blocked, and ``import ddpkit`` in a
    worker (``python -m ddpkit...`` under this launcher) unblocks it once its quiet handler is
    in place, so a Ctrl-C forwarded while the worker's interpreter starts waits for it instead
    of printing a traceback ("Could not import runpy module", a CI run on a loaded host).

    Only for ddpkit's own workers (``active``): a user's script may never import ddpkit, and a
    blocked SIGINT would be lost there. A signal mask is inherited through fork and exec, and
    only the thread that starts the worker blocks it, for the moment it does.

    Example::

        with holding_early_interrupts(cfg.module and cfg.script.startswith("ddpkit.")):
            torchrun(args)
    """
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler \
            import SubprocessHandler
        popen = SubprocessHandler._popen
    except (ImportError, AttributeError):  # another torch: its workers start as they do
        popen = None
    if not active or popen is None or not hasattr(signal, "pthread_sigmask"):
        yield
        return

    def blocked(handler: Any, *args: Any, **kwargs: Any) -> Any:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return popen(handler, *args, **kwargs)
        finally:  # a Ctrl-C meanwhile is delivered here now, as if it came a moment later
            signal.pthread_sigmask(signal.SIG_SETMASK, before)

    SubprocessHandler._popen = blocked
    try:
        yield
    finally:
        SubprocessHandler._popen = popen


class AgentWatchdog:
    """Exit when this process's workers have all exited but it has not reaped them for ``grace`` s
    while its main thread stood still (one call that does not return).

    torchrun's agent polls its workers between rendezvous-store calls; on a node cut off
    from the store a call can block for many minutes, so dead workers stay unreaped zombies
    and the launcher hangs. Used around the in-process torchrun call in ``ddpkit run``.
    A main thread that moves is not stuck: torch's log formatter imports ``torch._dynamo`` (and
    sympy) the first time the agent logs a failed worker, which took more than 20 s on a loaded
    host (every multinode scenario at once on 2 cores), and an agent doing so was once called
    stuck and its node ended. ``position`` (tests): the main thread's place, any comparable.

    Example::

        with AgentWatchdog("10.213.0.1:29400", grace=20):
            torchrun(args)
    """

    def __init__(self, endpoint: str, grace: float = 20.0, interval: float = 1.0,
                 exit: Callable[[int], Any] = os._exit,
                 list_children: Optional[Callable[[], Dict[int, str]]] = None,
                 position: Optional[Callable[[], Any]] = None) -> None:
        self.endpoint, self.grace, self.interval = endpoint, grace, interval
        self._exit = exit
        self._children = list_children or workers_or_children
        self._position = position or main_thread_position
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddpkit-agent-watchdog",
                                        daemon=True)

    def __enter__(self) -> "AgentWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

    def _watch(self) -> None:
        since: Optional[float] = None
        where = None
        while not self._stop.wait(self.interval):
            kids = self._children()
            all_dead = bool(kids) and all(state in "ZX" for state in kids.values())
            here = self._position()
            moved, where = here != where, here
            since = (time.monotonic() if since is None or moved else since) if all_dead else None
            if since is not None and time.monotonic() - since >= self.grace:
                self._give_up(sorted(kids))
                return

    def _give_up(self, pids: List[int]) -> None:
        code = 1
        for pid in pids:  # reap them ourselves: the agent never will
            try:
                _, status = os.waitpid(pid, os.WNOHANG)
                code = max(code, os.waitstatus_to_exitcode(status) if status else 1)
            except (ChildProcessError, OSError):
                pass
        sys.stderr.write(f"ddpkit run: this node's workers exited {self.grace:.0f} s ago but "
                         f"torchrun's agent is stuck on the rendezvous store {self.endpoint} "
                         "(network partition, or the store's node is gone); exiting\n")
        sys.stderr.flush()
        self._exit(code if code > 0 else 1)


def main_thread_position() -> Optional[Tuple[int, int]]:
    """Where the main thread is now: its innermost Python frame's code and line (``None`` once
    it has ended). The same value a while later means one call has not returned meanwhile.

    Example::

        main_thread_position()   # (139872, 417)
    """
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return None if frame is None else (id(frame.f_code), frame.f_lineno)


def _tcp_store(endpoint: str, timeout: float) -> Any:
    from torch.distributed import TCPStore

    host, port = split_endpoint(endpoint)
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def watch_nnodes(endpoint: str, nnodes: int | str, run_id: str = "ddpkit", timeout: float = 600.0,
                 is_host: bool = False, exit: Callable[[int], Any] = os._exit,
                 connect: Callable[[str, float], Any] = _tcp_store,
                 list_children: Callable[[], Dict[int, str]] = children) -> threading.Thread:
    """Start a thread that stops this node with one line if a node of the same rendezvous was
    started with another ``--nnodes`` (torchrun would wait out its join timeout instead);
    ``nnodes`` as given, ``2`` or ``2:3``: an elastic range must be the same on every node.

    The first node records its ``nnodes`` in the rendezvous store; a node that disagrees says
    so there too, so both sides exit. ``is_host``: this node serves the store, so it lingers
    a moment before exiting to let the others read why. The watch ends once this process has
    children (``list_children``: the workers started). Best effort: store errors are left to
    torchrun.

    Example::

        watch_nnodes("10.213.0.1:29400", nnodes=2)
    """
    key, conflict = f"ddpkit/{run_id}/nnodes", f"ddpkit/{run_id}/nnodes-conflict"

    def fail(other: str, linger: float) -> None:
        sys.stderr.write(f"error: this node was started with --nnodes {nnodes} but another node "
                         f"of the rendezvous at {endpoint} with --nnodes {other}: use the same "
                         "--nnodes on every node\n")
        sys.stderr.flush()
        time.sleep(linger)
        exit(2)

    def watch() -> None:
        try:
            store = connect(endpoint, timeout)
            seen = store.compare_set(key, "", str(nnodes)).decode()
            if seen != str(nnodes):
                store.set(conflict, str(nnodes))
                return fail(seen, 1.5 if is_host else 0.0)  # the others poll every 0.5 s
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not list_children():  # until workers start
                if store.check([conflict]):
                    return fail(store.get(conflict).decode(), 0.0)
                time.sleep(0.5)
        except Exception:  # noqa: BLE001 - torchrun reports store trouble in its own words
            return

    thread = threading.Thread(target=watch, name="ddpkit-nnodes-check", daemon=True)
    thread.start()
    return thread
