"""The launcher, watched from its ranks: a ``ddpkit run`` (torchrun's agent) that is stopped
(SIGSTOP, a debugger, a job control stop) holds the job's store on the first node, so ranks wait
for it in silence, and on any node nothing restarts or stops its ranks until it runs again. Its
stopped state is named in seconds by the node's first rank, as a stuck rank is
(:mod:`ddpkit.faults.stall`), and again once it runs; a store that stops answering while this
node's launcher runs (the first node's is stopped, or cannot be reached) is named too.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, Mapping, Optional

from .crash import _write
from .looks import stat_state
from .stops import launcher_pid

__all__ = ["LauncherWatch", "start_for_launcher"]

_STOPPED = ("T", "t")   # stopped by a signal; stopped by a tracer (a debugger)


def _name(pid: int) -> str:
    """``ddpkit run``, ``torchrun`` or the process's own name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return "launcher"
    text = " ".join(os.path.basename(w) for w in words[:4])
    if "ddpkit" in text and " run" in text:
        return "ddpkit run"
    return "torchrun" if "torchrun" in text or "torch.distributed.run" in text else \
        os.path.basename(words[0]) if words else "launcher"


class LauncherWatch:
    """A daemon thread that looks at process ``pid`` (the launcher) twice a second and says,
    once it has been stopped ``after`` seconds, which one and how to continue it; and, while it
    runs, when the job's store has kept a call waiting ``2 * after`` s (``store_wait()``: the
    seconds the current call has waited, or 0).

    Example::

        LauncherWatch(os.getppid(), after=5.0).start()
    """

    def __init__(self, pid: int, after: float, store_wait: Callable[[], float] = lambda: 0.0,
                 store_at: str = "", write: Callable[[str], None] = _write,
                 tick: float = 0.5) -> None:
        self.pid, self.after, self.store_wait, self.store_at = pid, after, store_wait, store_at
        self.write, self.tick = write, tick
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._stopped_since: Optional[float] = None
        self._said_stopped = self._said_store = False
        self._looking = threading.Lock()

    def start(self) -> "LauncherWatch":
        threading.Thread(target=self._run, name="ddpkit-launcher-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        """End the watch (at this rank's exit): a launcher said stopped that runs again is
        said so now, not left unsaid by a rank that ends before its next look."""
        self._stop.set()
        if self._said_stopped:
            self.look()

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            self.look()

    def look(self, now: Optional[float] = None) -> None:
        """One look (the thread's, or a test's with its own clock)."""
        with self._looking:
            self._look(time.monotonic() if now is None else now)

    def _look(self, now: float) -> None:
        if stat_state(f"/proc/{self.pid}/stat") in _STOPPED:
            self._stopped_since = self._stopped_since or now
            if not self._said_stopped and now - self._stopped_since >= self.after:
                self._said_stopped = True
                self.write(
                    f"ddpkit: this node's launcher ({_name(self.pid)}, pid {self.pid} on "
                    f"{self.host}) has been stopped for {now - self._stopped_since:.0f} s "
                    "(SIGSTOP, a debugger, a job control stop): ranks that need the job's store "
                    "wait for it, and nothing restarts or stops this node's ranks until it runs "
                    f"again; continue it with `kill -CONT {self.pid}` (or `fg` in its shell)\n")
            return
        if self._stopped_since is not None:
            if self._said_stopped:
                self.write(f"ddpkit: the launcher (pid {self.pid}) runs again, after "
                           f"{now - self._stopped_since:.0f} s stopped\n")
            self._stopped_since, self._said_stopped = None, False
        waited = self.store_wait()
        if waited >= 2 * self.after and not self._said_store:
            self._said_store = True
            self.write(f"ddpkit: the job's store{self.store_at} has not answered for "
                       f"{waited:.0f} s: the launcher that holds it (on the first node) is "
                       "stopped, or its node cannot be reached; the ranks wait for it\n")
        elif waited == 0.0:
            self._said_store = False


def start_for_launcher(after: float, store_wait: Callable[[], float],
                       environ: Mapping[str, str] = os.environ) -> Optional[LauncherWatch]:
    """The watch of this rank's launcher, on a node's first rank under torchrun's agent
    (``ddpkit run``, ``torchrun``); None elsewhere.

    Example::

        start_for_launcher(5.0, watch.store_wait)
    """
    if "TORCHELASTIC_RUN_ID" not in environ or environ.get("LOCAL_RANK", "0") != "0":
        return None
    at = (f" (at {environ['MASTER_ADDR']}:{environ['MASTER_PORT']})"
          if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT") else "")
    return LauncherWatch(launcher_pid(environ), after, store_wait, at).start()
