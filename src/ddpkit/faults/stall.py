"""A stuck rank named in seconds: each rank's watch thread says, every second, whether its
training thread is waiting in a collective, moving, or still; when ranks have waited ``after``
seconds (5 by default) for one that has not moved, the lowest waiting rank names it (host, pid,
last step, Python stack). A report, not a verdict: the job goes on waiting (it may recover) and
ends at the collective timeout or on Ctrl-C.

What counts as moving: a finished optimizer step, or a Python stack that changed between two
looks (a forward, an evaluation, a compilation: all move). What is allowed to take longer: a
checkpoint save or an evaluation ddpkit runs (:func:`phase`), a rank waiting for its
DataLoader (a slow start), and one running inside a single call into torch (a large forward or
backward on a machine so busy that one step takes many typical ones): 60 s each before they are
named. A rank whose watch thread has
gone silent for 3 s is not running at all (stopped, or holding the GIL in native code): its
stack is read with ``py-spy`` by a rank on its host.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Set, Tuple

from .crash import _write
from .looks import Look, stack_of
from .mismatch import mismatch_report, waiting_site
from .nativelog import quiet_native_warnings

__all__ = ["StallWatch", "phase", "after_from_env", "stop_current", "answer_stack_asks"]

AFTER_VAR = "DDPKIT_STALL_AFTER"   # seconds; 0 turns the watch off (`ddpkit run --stall-after`)
DEFAULT_AFTER = 5.0
_RECORD = "ddpkit/watch/{rank}"
_STACK_ASK = "ddpkit/watch/stack-ask/{rank}"
_STACK = "ddpkit/watch/stack/{rank}"
_ASKS = "ddpkit/watch/stack-asks"    # how many asks so far: a rank scans them only when it grows
_SILENT = 3.0          # a record older than this: the rank's process is not running
_LONGER = 60.0         # a save, an evaluation, a DataLoader's wait: named after this long
STRAGGLER_VAR = "DDPKIT_STRAGGLER_EVERY"   # seconds between straggler lines (default 300)

_PHASE: Dict[str, Any] = {"name": None, "since": 0.0}
_CURRENT: Dict[str, Any] = {"watch": None}   # one watch a process, however often setup runs


def stop_current() -> None:
    """Stop this process's watch, if one runs (before its process group is destroyed).

    Example::

        stop_current()
    """
    watch = _CURRENT["watch"]
    if watch is not None:
        watch.stop()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a stretch of this rank's work that may keep the others waiting for a while (a
    checkpoint save, an evaluation): it is named a stall only after 60 s.

    Example::

        with phase("checkpoint save"):
            torch.save(state, path)
    """
    outer = dict(_PHASE)
    _PHASE.update(name=name, since=time.monotonic())
    try:
        yield
    finally:
        _PHASE.update(outer)


def after_from_env(environ: Optional[Dict[str, str]] = None) -> float:
    """Seconds of waiting before a stuck rank is named: ``DDPKIT_STALL_AFTER`` or 5; 0 is off.

    Example::

        after_from_env({"DDPKIT_STALL_AFTER": "10"})   # 10.0
    """
    return _seconds((os.environ if environ is None else environ).get(AFTER_VAR), DEFAULT_AFTER)


def _seconds(value: Optional[str], default: float) -> float:
    try:
        seconds = float(value) if value else default
    except ValueError:
        return default
    return max(seconds, 0.0) if seconds == seconds else default


class StallWatch:
    """This rank's watch thread: its record in the store every ``interval`` s, and, on the
    lowest waiting rank, the report naming a rank the others have waited ``after`` s for.

    ``heartbeat`` (:class:`ddpkit.faults.hangs.Heartbeat`) gives the rank, the world size and
    the last finished step; ``store`` the job's key-value store; ``write`` prints a report.

    Example::

        watch = StallWatch(heartbeat, store, after=5.0).start()
        ...
        watch.stop()    # at exit
    """

    def __init__(self, heartbeat: Any, store: Any, after: float = DEFAULT_AFTER,
                 interval: float = 1.0, tick: float = 0.1, timeout: Optional[float] = None,
                 write: Optional[Callable[[str], None]] = None,
                 stack_of: Optional[Callable[[int], Optional[List[str]]]] = None) -> None:
        self.heartbeat, self.store = heartbeat, store
        self.rank, self.world_size = heartbeat.rank, heartbeat.world_size
        self.after, self.interval, self.tick, self.timeout = after, interval, tick, timeout
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._write = write or _write
        self._stack_of = stack_of
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._look: Optional[Look] = None
        self._reported: set = set()
        self._asks_seen = 0
        self._step_seen: Any = None
        self._step_times: List[float] = []  # seconds between finished steps (recent)
        self._step_at = time.monotonic()
        self._records_written = 0
        self._changes = 0      # step changes seen between records (0: the first step runs)
        self._wait_share: float = 0.0
        self._straggler_said = time.monotonic()
        self._straggler_every = _seconds(os.environ.get(STRAGGLER_VAR), 300.0)
        self._store_since: Optional[float] = None

    # -- life -----------------------------------------------------------------------------
    def start(self) -> "StallWatch":
        """Watch the calling thread (the training loop's) from a daemon thread; a watch
        started before in this process stops."""
        stop_current()
        _CURRENT["watch"] = self
        caller = threading.current_thread()
        self._look = Look(caller.ident or 0, getattr(caller, "native_id", None))
        self._thread = threading.Thread(target=self._run, name="ddpkit-stall-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: float = 2.0) -> None:
        """End the watch (before the process group goes: it uses the group's store)."""
        self._stop.set()
        if _CURRENT["watch"] is self:
            _CURRENT["watch"] = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait)

    def _run(self) -> None:
        next_record, failures = time.monotonic(), 0
        while not self._stop.wait(self.tick):
            try:
                self._look.take()
                now = time.monotonic()
                if now >= next_record:
                    next_record, self._store_since = now + self.interval, now
                    try:
                        with quiet_native_warnings():  # a store gone raises: tried again later
                            self._once()
                    finally:
                        self._store_since = None
                failures = 0
            except Exception:  # noqa: BLE001 - diagnostics must never break training
                failures += 1  # a store call that failed once: try again next time
                if failures >= 30:
                    return     # the store is gone (the job is ending): stop watching

    def store_wait(self) -> float:
        """Seconds this watch's current round of store calls has waited (0: none under way)."""
        since = self._store_since
        return 0.0 if since is None else time.monotonic() - since

    # -- one record -----------------------------------------------------------------------
    def _write_record(self) -> Tuple[float, str]:
        """This rank's record in the store; returns (seconds still, state)."""
        look, now = self._look, time.monotonic()
        step = self.heartbeat.last_step
        if step != self._step_seen:
            if self._step_seen is not None or self._records_written:
                self._changes += 1
            if isinstance(step, int) and isinstance(self._step_seen, int) \
                    and step > self._step_seen:
                each = (now - self._step_at) / (step - self._step_seen)
                self._step_times = (self._step_times + [each])[-50:]
            self._step_seen, self._step_at = step, now
            look.moved = max(look.moved, now)
        if look.looks:  # a running average over ~10 s
            self._wait_share += (look.waits / look.looks - self._wait_share) / 10.0
        look.waits = look.looks = 0
        still = now - look.moved
        record = {"host": self.host, "pid": self.pid, "step": step, "state": look.state,
                  "still": round(still, 1), "phase": _PHASE["name"],
                  "phase_for": round(now - _PHASE["since"], 1) if _PHASE["name"] else 0.0,
                  "wait_share": round(self._wait_share, 3), "step_s": self._typical_step(),
                  "first": self._changes == 0, "time": time.time()}
        if still >= 1.0 and look.frame is not None:  # waiting: where (a mismatch shows)
            if look.state == "waiting":
                record["site"] = waiting_site(look.frame)
            else:
                record["stack"] = stack_of(look.frame)
        self.store.set(_RECORD.format(rank=self.rank), json.dumps(record))
        self._records_written += 1
        self.heartbeat.flush()
        return still, look.state

    def _once(self) -> None:
        still, state = self._write_record()
        self._answer_stack_asks()
        waited = still if state == "waiting" else 0.0   # its stack stopped as the wait began
        now = time.monotonic()
        if waited >= self._limit():
            self._look_for_stuck(waited)
        elif now - self._straggler_said >= self._straggler_every and self.rank == 0:
            self._straggler_said = now
            self._say_straggler()

    def _typical_step(self) -> Optional[float]:
        times = sorted(self._step_times)
        return round(times[len(times) // 2], 3) if times else None

    def _limit(self) -> float:
        """Seconds of waiting before a look for the stuck: ``after``, or 4 typical steps."""
        typical = self._typical_step() or 0.0
        return max(self.after, 4.0 * typical)

    # -- the others -----------------------------------------------------------------------
    def _records(self) -> Dict[int, Dict[str, Any]]:
        found = {}
        for rank in range(self.world_size):
            key = _RECORD.format(rank=rank)
            if self.store.check([key]):
                found[rank] = json.loads(self.store.get(key))
        return found

    def _look_for_stuck(self, waited: float) -> None:
        records = self._records()
        now = time.time()
        waiting = sorted(r for r, rec in records.items()
                         if rec["state"] == "waiting" and now - rec["time"] < _SILENT)
        if not waiting or waiting[0] != self.rank:
            return  # the lowest waiting rank reports
        stuck = []
        for rank in range(self.world_size):
            rec = records.get(rank)
            if rec is None or rank in waiting:
                continue
            silent = now - rec["time"] >= _SILENT
            longer = rec.get("phase") or rec["state"] in ("loading", "computing") \
                or rec.get("first")
            allowed = _LONGER if longer else self._limit()
            if silent or rec["still"] >= allowed:
                stuck.append((rank, rec, silent))
        if not stuck and len(waiting) == self.world_size:   # all wait: in the same one?
            report = mismatch_report(records, self.world_size, waited)
            places = tuple((r, rec.get("site"), rec.get("step")) for r, rec in records.items())
            if report and places not in self._reported:
                self._reported.add(places)
                self._write(report + self._keeps_waiting())
            return
        stuck = [s for s in stuck if (s[0], s[1].get("step")) not in self._reported]
        if not stuck:
            return   # none, or each named already (a rank is named again at another step)
        self._reported.update((rank, rec.get("step")) for rank, rec, _ in stuck)
        self._write(self._report(stuck, waiting, waited, records[self.rank].get("step")))

    def _report(self, stuck: List[Any], waiting: List[int], waited: float,
                at: Optional[int]) -> str:
        lines = []
        others = ", ".join(map(str, waiting)) + ("" if at is None else f" (at step {at})")
        mine = at
        for rank, rec, silent in stuck:
            step = rec.get("step")
            if silent and isinstance(mine, int) and (step is None or mine > step):
                at = f"after step {mine}"   # the others finished it: so did it (its record lags)
            elif silent:  # its record is up to a second old: steps since then are unknown
                at = f"last step recorded {step}" if step is not None else "no step recorded"
            else:
                at = f"last finished step {step}" if step is not None else "no step finished"
            if silent:
                how = (f"no word from it for {time.time() - rec['time']:.0f} s (its process is "
                       "stopped, or its node cannot reach the others)")
                stack = self._stack_of_silent(rank, rec)
            elif rec.get("phase"):
                how = f"in its {rec['phase']} for {rec['phase_for']:.0f} s"
                stack = rec.get("stack")
            elif rec.get("first"):
                how = f"no step finished yet, its Python stack still for {rec['still']:.0f} s"
                stack = rec.get("stack")
            elif rec["state"] == "loading":
                how = f"waiting for its DataLoader for {rec['still']:.0f} s"
                stack = rec.get("stack")
            elif rec["state"] == "computing":
                how = f"inside one call into torch for {rec['still']:.0f} s"
                stack = rec.get("stack")
            else:
                how = f"its Python stack has not moved for {rec['still']:.0f} s"
                stack = rec.get("stack")
            lines.append(f"ddpkit: rank {rank} (pid {rec['pid']} on {rec['host']}, {at}) is "
                         f"stuck: {how}; rank{'s' if len(waiting) > 1 else ''} {others} "
                         f"waited {waited:.0f} s for it"
                         + ("; its Python stack, innermost first:" if stack else
                            f"; {_no_stack(silent, rec['host'] == self.host)}"))
            lines += [f"    {frame}" for frame in stack or []]
        return "".join(line + "\n" for line in lines) + self._keeps_waiting()

    def _keeps_waiting(self) -> str:
        timeout = f"{self.timeout:.0f} s" if self.timeout else "its collective timeout"
        return (f"ddpkit: the job keeps waiting (it may recover) until {timeout} "
                "(ddpkit run --timeout S), or stop it with Ctrl-C\n")

    def _stack_of_silent(self, rank: int, rec: Dict[str, Any]) -> Optional[List[str]]:
        """A stopped rank's stack: py-spy here if it runs on this host, else asked of a rank
        on its host; the stack it last wrote itself otherwise."""
        if rec.get("host") == self.host:
            return self._py_spy(rec["pid"]) or rec.get("stack")
        with contextlib.suppress(Exception):  # an answer to an earlier ask: not this one's
            self.store.delete_key(_STACK.format(rank=rank))
        self.store.set(_STACK_ASK.format(rank=rank), json.dumps(
            {"host": rec["host"], "pid": rec["pid"]}))
        self.store.add(_ASKS, 1)
        deadline = time.monotonic() + 3.0
        key = _STACK.format(rank=rank)
        while time.monotonic() < deadline:
            if self.store.check([key]):
                return json.loads(self.store.get(key)) or rec.get("stack")
            time.sleep(0.1)
            if self._look is not None:   # this rank must not fall silent while it asks
                self._look.take()
                self._write_record()
        return rec.get("stack")

    def _answer_stack_asks(self) -> None:
        self._asks_seen = answer_stack_asks(self.store, self.host, self._asks_seen,
                                            self.world_size, self._py_spy, skip=self.rank)

    def _py_spy(self, pid: int) -> Optional[List[str]]:
        if self._stack_of is not None:
            return self._stack_of(pid)
        from .hangs import python_stack

        return python_stack(pid)

    def _say_straggler(self) -> None:
        """Rank 0, every 5 minutes: a rank that works far longer a step than the others."""
        records = self._records()
        busy = {r: (1.0 - rec.get("wait_share", 0.0)) for r, rec in records.items()}
        if len(busy) < 2:
            return
        ordered = sorted(busy.values())
        median = ordered[len(ordered) // 2 - (len(ordered) % 2 == 0)]
        slowest = max(busy, key=busy.get)
        if median > 0 and busy[slowest] / median >= 1.5:
            rec = records[slowest]
            self._write(f"ddpkit: rank {slowest} (pid {rec['pid']} on {rec['host']}) is a "
                        f"straggler: {busy[slowest] / median:.1f}x slower than the median rank "
                        "(the others wait for it in every step)\n")


def answer_stack_asks(store: Any, host: str, seen: int, world_size: int,
                      read: Callable[[int], Optional[List[str]]], skip: Optional[int] = None,
                      mine: Optional[Set[int]] = None) -> int:
    """Read the stack of a stopped rank on ``host`` (of one of the pids ``mine``, if given)
    when a reporting rank asks; one store call while nobody asks, whatever the world size. A
    rank's watch answers for the ranks beside it, a node's launcher for its own workers
    (:mod:`ddpkit.launchers.stacks`). Returns the asks seen so far.

    Example::

        seen = answer_stack_asks(store, socket.gethostname(), seen, 4, python_stack)
    """
    asks = store.add(_ASKS, 0)
    if asks == seen:
        return seen
    for rank in range(world_size):
        key = _STACK_ASK.format(rank=rank)
        if rank == skip or not store.check([key]):
            continue
        ask = json.loads(store.get(key))
        answer = _STACK.format(rank=rank)
        if ask.get("host") == host and (mine is None or ask.get("pid") in mine) \
                and not store.check([answer]):
            stack = read(ask["pid"])
            if stack:  # one that cannot read it (no ptrace right) leaves it to one that can
                store.set(answer, json.dumps(stack))
    return asks


def _no_stack(silent: bool, here: bool) -> str:
    if silent and not here:
        return ("no rank on its host answered for its stack (a stopped process's stack is read "
                "with py-spy on its own host, by a rank there or by `ddpkit run`)")
    return "its Python stack could not be read (pip install py-spy)"
