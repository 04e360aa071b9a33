"""Stops the user (or the cluster) asked for: Ctrl-C ends a worker quietly with 130; while
:func:`ddpkit.fit` runs, SIGTERM and SIGUSR1 stop every rank after the same step, so it can save
a checkpoint first (preemption); elsewhere they keep their default (end at once, quietly).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator, Optional

__all__ = ["Stops", "StopRequested", "STOP_SIGNALS", "signal_name"]

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
