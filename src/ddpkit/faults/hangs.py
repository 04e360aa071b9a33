"""When a collective hangs: every rank's heartbeat kept in the rendezvous store, so the ranks
that timed out can name the ones that never arrived, where they run and their Python stacks.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Heartbeat", "python_stack"]

_KEY = "ddpkit/heartbeat/{rank}"
_WAITING = "ddpkit/waiting/{rank}"
_LEFT = "ddpkit/left/{rank}"
_REPORTED = "ddpkit/hang-reported"

# One optimizer hook per process however often ddpkit.setup runs: it counts for the Heartbeat
# that asked last (the one the error hook reads), held weakly so an old one can go.
_WATCH: Dict[str, Any] = {"handle": None, "progress": lambda: None}


class Heartbeat:
    """This rank's place (host, pid, last step) in the store the ranks share; read on a hang.

    Writing is cheap: at most one small store write per ``interval`` seconds. Without a store
    (one process, Horovod) nothing is written or read; ``last_step`` is still kept.

    Example::

        heartbeat = Heartbeat(store, rank=0, world_size=2).started()
        heartbeat.step(57)                      # from the training loop
        heartbeat.watch_optimizers()            # or: every optimizer.step() counts by itself
        stuck = heartbeat.not_arrived()         # after a collective timed out on this rank
    """

    def __init__(self, store: Any, rank: int, world_size: int, interval: float = 1.0) -> None:
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.last_step: Optional[int] = None
        self.reporter = True   # after not_arrived(): is this the lowest rank that waited?
        self._written = 0.0
        self._written_step: Optional[int] = None
        self._stepped: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self._base = 0         # the step last set by step(n); optimizer steps count from it

    def _write(self) -> None:
        if self.store is None:
            return
        self._written_step = self.last_step
        record = {"host": self.host, "pid": self.pid, "step": self.last_step,
                  "time": time.time()}
        try:
            self.store.set(_KEY.format(rank=self.rank), json.dumps(record))
        except Exception:  # noqa: BLE001 - diagnostics must never break training
            self.store = None
        self._written = time.monotonic()

    def flush(self) -> None:
        """Write the last step now if it changed since the last write (from a watch thread, so
        a hang report never names a step older than a second)."""
        if self.store is not None and self.last_step != self._written_step:
            self._write()

    def started(self) -> "Heartbeat":
        """Record host and pid as the job starts."""
        self._write()
        return self

    def step(self, step: int) -> None:
        """Record the last finished optimizer step (written at most once per ``interval``).

        The absolute value (``fit``, a resumed checkpoint): optimizer steps counted by
        :meth:`watch_optimizers` continue from it.
        """
        self._base = step
        self._stepped.clear()
        self._finished(step)

    def _finished(self, step: int) -> None:
        self.last_step = step
        if time.monotonic() - self._written >= self.interval:
            self._write()

    def watch_optimizers(self) -> Any:
        """Count every ``optimizer.step()`` of this process as a finished step, so a hang report
        knows the step of a script's own loop too. Idempotent; returns the hook's handle.

        Each optimizer is counted on its own and the step is the largest count: two optimizers
        (a GAN) or one that steps another (``ZeroRedundancyOptimizer``) count once per step.

        Example::

            heartbeat.watch_optimizers()
            optimizer.step()          # heartbeat.last_step == 1
        """
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _WATCH["progress"] = weakref.ref(self)
        handle = _WATCH["handle"]
        hooks = handle.hooks_dict_ref() if handle is not None else None
        if hooks is None or handle.id not in hooks:  # none yet, or removed by its owner
            _WATCH["handle"] = register_optimizer_step_post_hook(_optimizer_stepped)
        return _WATCH["handle"]

    def _optimizer_stepped(self, optimizer: Any) -> None:
        count = self._stepped.get(optimizer, 0) + 1
        self._stepped[optimizer] = count
        if self.last_step is None or self._base + count > self.last_step:
            self._finished(self._base + count)

    def leaving(self) -> None:
        """Record that this process is ending (at exit): a peer still waiting on it can say so."""
        if self.store is None:
            return
        try:
            self.store.set(_LEFT.format(rank=self.rank), json.dumps({"step": self.last_step}))
        except Exception:  # noqa: BLE001 - the group may be gone already
            pass

    def who_left(self) -> List[Dict[str, Any]]:
        """The other ranks whose process has ended, with their last step (empty if unknown).

        Example::

            heartbeat.who_left()   # [{'rank': 1, 'step': 12}]
        """
        if self.store is None:
            return []
        try:
            keys = [(r, _LEFT.format(rank=r)) for r in range(self.world_size) if r != self.rank]
            return [{"rank": r, **json.loads(self.store.get(k))} for r, k in keys
                    if self.store.check([k])]
        except Exception:  # noqa: BLE001
            return []

    def not_arrived(self, wait: float = 2.0) -> Optional[List[Dict[str, Any]]]:
        """After a collective timed out here: the ranks that are not waiting in it too.

        This rank says it is waiting, gives the others ``wait`` seconds to say so, and returns
        the records (rank, host, pid, last step) of the ranks that did not; None without a
        store. ``self.reporter`` is then True on the lowest waiting rank only.
        """
        if self.store is None:
            return None
        self._write()
        try:
            self.store.set(_WAITING.format(rank=self.rank), "1")
            deadline = time.monotonic() + wait
            waiting = self._waiting()
            while len(waiting) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.1)
                waiting = self._waiting()
            missing = [r for r in range(self.world_size) if r not in waiting]
            self.reporter = min(waiting) == self.rank
            return [self._record(r) for r in missing]
        except Exception:  # noqa: BLE001
            return None

    def reported(self) -> None:
        """Tell the other waiting ranks that the hang report is out."""
        try:
            self.store.set(_REPORTED, "1")
        except Exception:  # noqa: BLE001
            pass

    def wait_for_report(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the reporting rank has printed its report."""
        deadline = time.monotonic() + timeout
        try:
            while not self.store.check([_REPORTED]) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:  # noqa: BLE001
            pass

    def _waiting(self) -> List[int]:
        return [r for r in range(self.world_size)
                if self.store.check([_WAITING.format(rank=r)])]

    def _record(self, rank: int) -> Dict[str, Any]:
        key = _KEY.format(rank=rank)
        record = json.loads(self.store.get(key)) if self.store.check([key]) else {}
        return {"rank": rank, **record}


def _optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    heartbeat = _WATCH["progress"]()
    if heartbeat is not None:
        try:
            heartbeat._optimizer_stepped(optimizer)
        except Exception:  # noqa: BLE001 - diagnostics must never break a training step
            pass


def python_stack(pid: int, frames: int = 6, timeout: float = 10.0) -> Optional[List[str]]:
    """The innermost frames of process ``pid``'s main thread (``py-spy dump``): at least
    ``frames``, and down to the first frame in neither torch nor Python's standard library (the
    script's or ddpkit's call into them) and one more; None when py-spy is missing or cannot
    read it (:func:`stack_or_why` says which).

    Example::

        python_stack(4242)   # ['wait_forever (train.py:12)', 'main (train.py:30)', ...]
    """
    return stack_or_why(pid, frames, timeout)[0]


def stack_or_why(pid: int, frames: int = 6,
                 timeout: float = 10.0) -> Tuple[Optional[List[str]], str]:
    """:func:`python_stack` and, when there is none, why in a few words for a report's line:
    ``'pip install py-spy to see its Python stack'`` or what py-spy said.

    Example::

        stack, why = stack_or_why(4242)
    """
    tool = shutil.which("py-spy") or _next_to_python("py-spy")
    if tool is None:
        return None, "pip install py-spy to see its Python stack"
    try:
        # --nonblocking: reads a stopped process too, and never pauses a running one
        out = subprocess.run([tool, "dump", "--nonblocking", "--json", "--pid", str(pid)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"py-spy could not read its stack in {timeout:g} s"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"py-spy could not run: {exc}"
    try:
        threads = json.loads(out.stdout)
    except ValueError:
        said = (out.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return None, f"py-spy could not read its stack: {said}"
    main = [t for t in threads if t.get("thread_name") == "MainThread"
            or t.get("os_thread_id") == pid]
    if not main:
        return None, "py-spy found no main thread in it"
    return _frames_to_show([(f["name"], f["filename"], f["short_filename"], f["line"])
                            for f in main[0]["frames"]], frames), ""


def _frames_to_show(stack: List[Tuple[str, str, str, int]], frames: int = 6) -> List[str]:
    """``name (short file:line)`` for the innermost frames of ``stack`` (innermost first): at
    least ``frames``, down to the first frame outside torch and the standard library and one
    more, 24 at most. A stop inside DDP's forward is often several torch and contextlib frames
    deep; a stack that ends there says little."""
    stdlib = tuple(os.path.join(os.path.realpath(sysconfig.get_paths()[k]), "")
                   for k in ("stdlib", "platstdlib"))

    def ours(filename: str, short: str) -> bool:
        real = os.path.realpath(filename)
        return not (short.startswith("torch/") or filename.startswith("<frozen ")
                    or (real.startswith(stdlib) and "-packages" + os.sep not in real))

    outside = next((i for i, (_, path, short, _) in enumerate(stack) if ours(path, short)),
                   len(stack) - 1)
    return [f"{name} ({short}:{line})"
            for name, _, short, line in stack[:min(max(frames, outside + 2), 24)]]


def _next_to_python(name: str) -> Optional[str]:
    import sys

    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else None


def stop_local(records: List[Dict[str, Any]]) -> List[int]:
    """SIGKILL the stuck ranks that run on this host (the job has failed; a stopped process
    would otherwise hold the launcher for its whole shutdown grace). Returns the pids killed.

    Example::

        stop_local([{"rank": 1, "host": socket.gethostname(), "pid": 4242}])   # [4242]
    """
    here, killed = socket.gethostname(), []
    for rec in records:
        if rec.get("host") == here and rec.get("pid") and rec["pid"] != os.getpid():
            try:
                os.kill(rec["pid"], signal.SIGKILL)
                killed.append(rec["pid"])
            except OSError:
                pass
    return killed
