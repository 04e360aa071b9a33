"""Stops the user (or the cluster) asked for: SIGINT, SIGTERM and SIGUSR1 in a worker end it
quietly with 128 + the signal, or, while :func:`ddpkit.fit` runs, after the current step on
every rank (so it can save a checkpoint first: preemption).
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
        """Handle the stop signals in this process (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        self.installed, self._pid = True, os.getpid()
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker): its own rules
            if signum == signal.SIGINT:
                signal.default_int_handler(signum, frame)
            quiet_exit(128 + signum)
        first = self.signum is None
        if first:
            self.signum, self.received_at = signum, time.monotonic()
        if first and self._graceful and signum in _GRACEFUL:
            return  # the loop stops after this step, on every rank
        quiet_exit(128 + signum)

    @contextlib.contextmanager
    def graceful(self) -> Iterator["Stops"]:
        """While inside, SIGTERM / SIGUSR1 only mark the stop; a second signal still ends at once."""
        self._graceful += 1
        try:
            yield self
        finally:
            self._graceful -= 1

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
