"""Stops the user (or the cluster) asked for: Ctrl-C ends a worker quietly with 130; while
:func:`ddpkit.fit` runs, SIGTERM and SIGUSR1 stop every rank after the same step, so it can save
a checkpoint first (preemption); elsewhere they keep their default (end at once, quietly).
A worker of ``ddpkit run`` also stops when its launcher dies (:func:`die_with_launcher`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator, List, Mapping, Optional

__all__ = ["Stops", "StopRequested", "STOP_SIGNALS", "signal_name", "die_with_launcher",
           "proc_stat", "LAUNCHER_PID_VAR", "FORKED_BY_VAR", "launcher_pid"]

#: The signals a worker handles. SIGINT stops at once (Ctrl-C); SIGTERM (what a launcher, Slurm
#: or Kubernetes sends before a kill) and SIGUSR1 (Slurm's ``--signal``) stop after the step.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_GRACEFUL = (signal.SIGTERM, signal.SIGUSR1)


def signal_name(number: int) -> str:
    """``SIGTERM`` for 15, and so on.

    Example::

        signal_name(10)   # 'SIGUSR1'
    """
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class StopRequested(SystemExit):
    """Raised on every rank when the ranks agreed to stop for a signal; exits with 128 + it.

    Example::

        raise StopRequested(signal.SIGTERM)   # the process exits with status 143
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + int(signum))
        self.signum = int(signum)


class Stops:
    """This process's stop signals: quiet exits, or a stop after the step while a loop runs.

    :func:`ddpkit.setup` installs it in the workers of a launcher (never in a plain one-process
    script, where Ctrl-C keeps its Python meaning); the runtime keeps it as ``rt.stops``.

    Example::

        stops = Stops().install()
        with stops.graceful():                 # inside a training loop
            for step in ...:
                ...
                signum = stops.poll(rt.engine)   # every rank, once per step
                if signum is not None:
                    save_checkpoint(...)
                    raise StopRequested(signum)
            stops.settle()
    """

    def __init__(self) -> None:
        self.signum: Optional[int] = None     # the first stop signal received
        self.received_at: Optional[float] = None
        self.installed = False
        self._graceful = 0
        self._pid = os.getpid()
        self._pending: Any = None

    def install(self) -> "Stops":
        """Handle Ctrl-C (SIGINT) quietly in this process; SIGTERM and SIGUSR1 are handled only
        inside :meth:`graceful` (elsewhere their default kills at once, even a process blocked
        in native code). Main thread only; a no-op elsewhere."""
        if threading.current_thread() is not threading.main_thread():
            return self
        signal.signal(signal.SIGINT, self._handle)
        self.installed, self._pid = True, os.getpid()
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker): its own rules
            if signum == signal.SIGINT:
                signal.default_int_handler(signum, frame)
            return  # SIGTERM / SIGUSR1 are for the rank itself; the child ends with it
        graceful = self._graceful and signum in _GRACEFUL
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()
            if graceful:
                return  # the loop stops after this step, on every rank
        elif graceful and signum == self.signum:
            return  # the same request again (Slurm and the agent both pass it on)
        quiet_exit(128 + signum)

    @contextlib.contextmanager
    def graceful(self) -> Iterator["Stops"]:
        """While inside, SIGTERM / SIGUSR1 only mark the stop (the same signal again too); any
        other stop signal still ends at once."""
        main = self.installed and threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self._handle) for sig in _GRACEFUL} if main else {}
        self._graceful += 1
        try:
            yield self
        finally:
            self._graceful -= 1
            # a context left open (a Checkpointer never closed) is closed by the garbage
            # collector, in whichever thread collects: only the main thread may set handlers
            if threading.current_thread() is threading.main_thread():
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def poll(self, engine: Any) -> Optional[int]:
        """The stop signal the ranks agreed on, one poll late, or None: every rank calls it at
        the same points (once per optimizer step in ``fit``).

        Each poll starts a reduction (max over ranks) of this rank's signal without waiting and
        reads the previous poll's, long finished by then, so asking costs no waiting.
        """
        if not self.installed:
            return None
        previous, self._pending = self._pending, engine.start_reduce(int(self.signum or 0), "max")
        signum = int(previous.result()) if previous is not None else 0
        return signum or None

    def ask_now(self, engine: Any) -> Optional[int]:
        """The stop signal if any rank received one, waiting for the answer (every rank calls
        it: at the end of a loop, so a signal that came during its last steps is not lost)."""
        if not self.installed:
            return None
        self.settle()
        return int(engine.start_reduce(int(self.signum or 0), "max").result()) or None

    def settle(self) -> None:
        """Wait for the reduction still under way (before other collectives or the exit)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None


def quiet_exit(status: int) -> None:
    """Flush and leave at once: no traceback, no finalisers (a stop the user asked for)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


#: Set for the workers of ``ddpkit run``: the launcher's pid. ``ddpkit.setup`` in a worker whose
#: parent is that process asks the kernel to kill it when the launcher dies (Linux).
LAUNCHER_PID_VAR = "DDPKIT_LAUNCHER_PID"
#: Set for the workers ``ddpkit run`` forked from its fork server (ddpkit.launchers.forked):
#: the launcher's pid, where ``DDPKIT_LAUNCHER_PID`` names their parent, the server.
FORKED_BY_VAR = "DDPKIT_FORKED_BY"


def launcher_pid(environ: Optional[Mapping[str, str]] = None) -> int:
    """This worker's launcher: its parent, or, forked from the launcher's fork server, the
    process ``DDPKIT_FORKED_BY`` names.

    Example::

        launcher_pid()   # 4242
    """
    environ = os.environ if environ is None else environ
    forked_by = environ.get(FORKED_BY_VAR, "")
    return int(forked_by) if forked_by.isdigit() else os.getppid()

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def proc_stat(pid: int | str) -> Optional[List[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state letter, parent pid,
    ...), or None if the process is gone (Linux).

    Example::

        proc_stat(4242)[:2]   # ['S', '4200']
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the command name may contain spaces and ')'


def _started_at(pid: int | str) -> Optional[int]:
    """When ``pid`` started (clock ticks since boot), or None: gone, or a zombie."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] in "ZX" else int(fields[19])


def die_with_launcher(environ: Optional[dict] = None, sig: int = signal.SIGKILL) -> bool:
    """In a worker of ``ddpkit run``: have the kernel send ``sig`` when the launcher dies.

    torchrun starts workers in their own session, so a killed launcher (``kill -9``, OOM
    killer) leaves them running: on several nodes the job then fails only after torchrun's
    300 s exit barrier. Applies only when ``DDPKIT_LAUNCHER_PID`` (set by ``ddpkit run``) is
    this process's parent; a no-op returning False elsewhere (other launchers, a process a
    worker started, not Linux). A worker whose launcher died before this call (while the
    worker was still importing, say) gets ``sig`` at once: it would run on with nobody to stop
    it, holding its launcher's output open.

    Example::

        die_with_launcher()   # True in a worker of `ddpkit run` on Linux
    """
    environ = os.environ if environ is None else environ
    launcher = environ.get(LAUNCHER_PID_VAR, "")
    if not sys.platform.startswith("linux") or not launcher.isdigit():
        return False
    if os.getppid() != int(launcher):
        began, mine = _started_at(launcher), _started_at(os.getpid())
        if began is None or (mine is not None and began > mine):  # gone (or its pid reused)
            with contextlib.suppress(OSError, ValueError):  # its output may be gone too
                sys.stderr.write(f"ddpkit: this worker's launcher (pid {launcher}) is gone; "
                                 "stopping\n")
                sys.stderr.flush()
            os.kill(os.getpid(), sig)
        return False  # started by something else (e.g. a grandchild of the launcher)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != int(launcher):  # the launcher died before prctl took effect
        os.kill(os.getpid(), sig)
    return True
