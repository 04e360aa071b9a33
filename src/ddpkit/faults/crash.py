"""When things go wrong: one error line per failure instead of a traceback per rank, collective
timeouts named. (Workers that die with their launcher: :mod:`ddpkit.faults.stops`, re-exported here.)
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Optional

import torch

from ..base.errors import DDPKitError, JobSetupError
from .alike import (EVERY_RANK, failure_digest, heard, said_by_rank_0, said_for_every_rank,
                    where)
from .stops import LAUNCHER_PID_VAR, die_with_launcher, quiet_exit  # noqa: F401 (re-exported)

__all__ = ["install_error_hook", "collective_timeout", "is_peer_failure", "die_with_launcher",
           "note_peer_loss", "PEER_LOSS_SUFFIX",
           "failure_digest", "LAUNCHER_PID_VAR"]

_TIMEOUT_PATTERNS = (
    # gloo: "[.../unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation to complete"
    re.compile(r"Timed out waiting (?P<ms>\d+)\s*ms for (?P<what>\w+) operation"),
    # NCCL watchdog: "... WorkNCCL(SeqNum=7, OpType=ALLREDUCE, ...) ran for 600012 milliseconds
    # before timing out" / "Timeout(ms)=600000"
    re.compile(r"OpType=(?P<op>\w+).*?Timeout\(ms\)=(?P<ms>\d+)", re.S),
    # gloo, for the other operations on a connection that timed out (DDP's buffer broadcast
    # beside a stopped rank): no figure in it; the group's own timeout is said instead
    re.compile(r"Application timeout caused pair closure"),
)


def collective_timeout(exc: BaseException, tb: Any = None, single_node: bool = False,
                       timeout_s: Optional[float] = None) -> Optional[str]:
    """One line for a collective that timed out (gloo or NCCL), or None for other errors.

    Names the collective (from the traceback: ``all_reduce``, ``barrier``, DDP's gradient
    all-reduce in ``backward``...), where the script called it, the timeout (from the message,
    else ``timeout_s``, the group's), and what to check (on one node: no network advice).

    Example::

        collective_timeout(RuntimeError("[x.cc:78] Timed out waiting 6000ms for recv operation "
                                        "to complete"))
        # 'a collective timed out after 6 s (...): a peer rank stopped answering: ...'
    """
    text = str(exc)
    match = next((m for m in (p.search(text) for p in _TIMEOUT_PATTERNS) if m), None)
    if match is None:
        return None
    ms = match.groupdict().get("ms")
    seconds = int(ms) / 1000 if ms else timeout_s
    op, where = _collective_site(tb if tb is not None else exc.__traceback__)
    if op is None and match.groupdict().get("op"):
        op = match.group("op").lower()
    detail = _gist(re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0]), 160)
    if "gloo" in text.lower():
        detail = f"gloo: {detail}"
    after = f" after {seconds:g} s" if seconds else ""
    head = (f"{'collective ' + op if op else 'a collective'} timed out{after} "
            f"({'called at ' + where + '; ' if where else ''}{detail}): a peer rank stopped "
            "answering")
    if single_node:
        return (f"{head}: it is stuck or stopped (a deadlock, a debugger, SIGSTOP), busy in work "
                "the others skip (uneven data, code that runs on some ranks only), or calls "
                "collectives in another order; raise ddpkit.setup(timeout=...) if it "
                "legitimately needs longer")
    return (f"{head}: check the network between the nodes (or pass --iface NAME), that every "
            "node is still running (the first error on another node is the cause), or raise "
            "ddpkit.setup(timeout=...)")


def _collective_site(tb: Any) -> "tuple[Optional[str], Optional[str]]":
    """(collective name, "file:line" in the caller's code) from a traceback, innermost first."""
    if tb is None:
        return None, None
    return collective_site(traceback.extract_tb(tb))


def collective_site(frames: Any) -> "tuple[Optional[str], Optional[str]]":
    """(collective name, "file:line via the ddpkit function called") from a stack's frames
    (``traceback.extract_stack``, outermost first): a traceback's or a waiting thread's.

    Example::

        collective_site(traceback.extract_stack(frame))   # ('all_reduce', 'train.py:6 via ...')
    """
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # ddpkit/
    op = None
    for frame in reversed(frames):
        name = frame.name
        if frame.filename.endswith("distributed_c10d.py") and not name.startswith("_") \
                and name != "wrapper":
            op = name
            break
        if frame.filename.startswith(torch_dir) and name in ("backward", "_engine_run_backward"):
            op = "gradient all-reduce in backward (DDP)"
            break
        if frame.filename.startswith(ours) and name in ("result", "tensor_result"):
            op = "all_reduce"  # started without waiting (engines.Reduction), waited for here
            break
    outside = [f for f in frames if not f.filename.startswith((torch_dir, "<frozen"))]
    user = next((f for f in reversed(outside) if not f.filename.startswith(ours)), None)
    where = f"{os.path.basename(user.filename)}:{user.lineno}" if user else None
    # The ddpkit function the script called (comm.reduce), not where inside ddpkit it ended up;
    # without a user frame (ddpkit's own job): the ddpkit code that called the rank utilities.
    if user is not None:
        entered = next((f for f in outside[outside.index(user) + 1:]
                        if f.filename.startswith(ours)), None)
    else:
        mine = [f for f in outside if f.filename.startswith(ours)]
        callers = [f for f in mine if not _dotted(f, ours).startswith(_PLUMBING)]
        entered = callers[-1] if callers else (mine[-1] if mine else None)
    if entered is not None:
        via = f"{_dotted(entered, ours)}.{entered.name}"
        where = f"{where} via {via}" if where else via
    return op, where


_PLUMBING = ("ddpkit.engines.comm", "ddpkit.engines")  # rank utilities: name who called them


def _dotted(frame: Any, root: str) -> str:
    return "ddpkit." + os.path.relpath(os.path.splitext(frame.filename)[0], root).replace(os.sep, ".")


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because another rank died first: a consequence, not the cause.

    Example::

        is_peer_failure(RuntimeError("[../tcp/pair.cc:598] Connection closed by peer"))   # True
    """
    text = str(exc)
    return any(marker in text for marker in _PEER_LOST)


_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\]\s*")  # [/x/gloo/pair.cc:553]


def _gist(text: str, limit: int = 200) -> str:
    """An error message for a one-line report: on one line, without C++ source locations, at
    most ``limit`` characters, cut after a sentence or else between words (never inside one).

    Example::

        _gist("[/w/gloo/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1968. This is "
              "typically caused by a remote worker crashing. Check the logs ...", 60)
        # 'Connection closed by peer [10.0.0.2]:1968.'
    """
    text = " ".join(_SOURCE.sub("", text).split())
    if len(text) <= limit:
        return text
    head = text[:limit + 1]
    end = max(head.rfind(". "), head.rfind("; "))
    return head[:end + 1] if end >= limit // 3 else head[:limit - 3].rsplit(" ", 1)[0] + " ..."


def _restart_follows() -> bool:
    # torchrun's agent restarts the group while it has restarts left, and `ddpkit run` names the
    # rank that failed: a peer's "stopped" line would only be noise before the restart.
    with contextlib.suppress(ValueError):
        return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))
    return False


def _record_root_cause(exc: BaseException, text: str, **mark: str) -> None:
    # torchrun's error file, in its own format, names the rank that failed first (see
    # ddpkit.launchers.torchrun.run); ranks that merely lost a peer write none.
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": {
        "py_callstack": text, "timestamp": str(int(time.time())), **mark}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # reporting must never mask the real error
        pass


#: Beside torchrun's error file: where a rank that lost a peer says at which step, and which.
PEER_LOSS_SUFFIX = ".peer-lost.json"


def note_peer_loss(exc: BaseException, heartbeat: Any) -> None:
    """For ``ddpkit run``'s restart line: the step this rank reached and the peer address gloo
    named, written beside torchrun's error file (which stays for the rank that failed first).

    Example::

        note_peer_loss(RuntimeError("Connection closed by peer [10.0.0.3]:1968"), heartbeat)
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # gloo names the peer as [address]:port: "Connection closed by peer [10.0.0.3]:1968" when it
    # closed its socket, "Read error [10.0.0.3]:1968: Connection reset by peer" when its host reset
    # it (a killed node); IPv6 addresses are bracketed alike.
    peer = re.search(r"\[([0-9A-Fa-f.:]+)\]:\d+", str(exc))
    note = {"step": getattr(heartbeat, "last_step", None), "peer": peer.group(1) if peer else None}
    with contextlib.suppress(OSError):
        with open(path + PEER_LOSS_SUFFIX, "w") as f:
            json.dump(note, f)


def install_error_hook(rank: int, delay: float = 3.0, stops: Any = None,
                       heartbeat: Any = None, single_node: bool = False,
                       timeout_s: Optional[float] = None) -> None:
    """Report an uncaught error once instead of once per rank.

    Rank 0 reports at once; other ranks wait ``delay`` seconds first, by which time a launcher
    that saw rank 0 fail has stopped them, so an error every rank hits is printed once. With
    ``heartbeat``'s store (one node) no rank waits: the first rank to fail prints its traceback
    and each rank that fails the same way one line, ``rank N failed the same way (...)``;
    different errors are each printed. A
    :class:`DDPKitError` is one line (no traceback) and exit status 2; a collective that failed
    only because a peer died is one line too, so the failing rank's traceback stands out; a
    collective that timed out is one line on every rank (:func:`collective_timeout`;
    ``timeout_s``: the group's timeout, said where the error does not give it).
    Install it after the process group exists: PyTorch wraps ``sys.excepthook`` at init.
    With ``stops`` (:class:`ddpkit.faults.stops.Stops`), an error after a stop signal is the stop's
    consequence: the process leaves quietly with 128 + the signal. With ``heartbeat``
    (:class:`ddpkit.faults.hangs.Heartbeat`) on one node, a timed-out collective names the ranks that
    never arrived, with their last step and Python stack, from the lowest waiting rank only.

    Example::

        install_error_hook(env.rank)
    """
    def hook(kind: type, value: BaseException, tb: Any) -> None:
        prefix = "" if rank == 0 else f"[rank {rank}] "
        if stops is not None and stops.signum is not None and _stop_consequence(value):
            quiet_exit(128 + stops.signum)  # a consequence of the stop the user asked for
        if is_peer_failure(value):
            left = heartbeat.who_left() if heartbeat is not None else []
            if left:  # a rank ended its script while this one still waited on it
                _record_root_cause(value, "".join(traceback.format_exception(kind, value, tb)))
                _write(f"{prefix}error: {_left_early(left, tb)}\n")
                os._exit(1)
            if _restart_follows():  # ddpkit run names the rank that failed, then restarts
                note_peer_loss(value, heartbeat)
                os._exit(1)
            first = _gist(str(value), 120)  # the first sentences: what happened, not advice
            _write(f"{prefix}stopped: a peer process failed during a collective ({first})\n")
            os._exit(1)
        timed_out = collective_timeout(value, tb, single_node, timeout_s)
        if timed_out is not None:
            # Every rank of a cut-off node times out alike: one line each, at once (no delay:
            # on several nodes each launcher sees only its own ranks). On one node the ranks
            # that did wait name the ones that did not.
            text = "".join(traceback.format_exception(kind, value, tb))
            _record_root_cause(value, text)
            if heartbeat is not None and single_node and heartbeat.store is not None:
                _report_hang(heartbeat, f"{prefix}error: {timed_out}\n")
            _write(f"{prefix}error: {timed_out}\n")
            os._exit(1)
        text = "".join(traceback.format_exception(kind, value, tb))
        if isinstance(value, JobSetupError):  # every rank found the same: rank 0 says it
            _record_root_cause(value, text)
            if rank == 0:
                _write(f"error: {value}\n")
                # On several nodes this node's agent serves the rendezvous store: the others'
                # agents close the rendezvous through it before it goes (no noise from them).
                time.sleep(delay if heartbeat is not None and not single_node else 0.0)
            os._exit(2)
        if isinstance(value, DDPKitError):
            store = heartbeat.store if heartbeat is not None and single_node else None
            if rank != 0 and store is None:
                time.sleep(delay)
            _record_root_cause(value, text)
            if not said_by_rank_0(store, rank, str(value), delay):  # rank 0 said the same
                _write(f"{prefix}error: {value}\n")
            if rank == 0 and store is not None:
                heard(store, heartbeat.world_size, str(value), delay)
            os._exit(2)
        shared = heartbeat is not None and heartbeat.store is not None
        if shared and _restart_follows() and _every_rank(heartbeat, rank, value, tb, text):
            os._exit(1)
        if rank != 0 and not shared:  # with the store, ranks that fail alike agree on one
            time.sleep(delay)
        _record_root_cause(value, text)
        _print_once(heartbeat if shared else None, rank, value, text)
        os._exit(1)

    hook.ddpkit = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_FAILED = "ddpkit/failed/{digest}"   # how many ranks failed with this traceback
_FAILURES = "ddpkit/failures"         # how many ranks have printed their failure
def _every_rank(heartbeat: Any, rank: int, value: BaseException, tb: Any, text: str) -> bool:
    """An error every rank raised alike, said once in one line; marked so that ``ddpkit run``
    does not restart it (:mod:`ddpkit.launchers.restarts`)."""
    line = (f"error: {type(value).__name__}: {_gist(str(value))} (at {where(tb)}); every rank "
            "failed the same way, so it was not restarted (it would only come back): fix it, "
            "then run the same command again\n")
    if not said_for_every_rank(heartbeat.store, heartbeat.world_size, rank, line, text):
        return False
    _record_root_cause(value, text, ddpkit=EVERY_RANK)
    return True


def _print_once(heartbeat: Any, rank: int, value: BaseException, text: str,
                wait: float = 2.0, linger: float = 1.0) -> None:
    """This rank's traceback, or one line when another rank printed the same one already.

    Through the store (5 s timeout, every wait bounded): the first rank to claim a digest prints
    the traceback; the others wait for it (``wait`` s; the traceback after all if it never
    comes, so no error is lost), then say they failed the same way. Each then lingers up to
    ``linger`` s for the other ranks to print theirs: the launcher stops every rank as soon as
    one has exited, and a rank that failed differently a moment later would go unheard.
    """
    prefix = "" if rank == 0 else f"[rank {rank}] "
    full = "".join(prefix + line + "\n" for line in text.splitlines())
    store = heartbeat.store if heartbeat is not None else None
    try:
        store.set_timeout(timedelta(seconds=5))  # an unanswered store must not hold the exit
        key = _FAILED.format(digest=failure_digest(text))
        first = store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - no store (or no answer): every rank prints its own
        _write(full)
        return
    if first or not _wait_for(store, key + "/printed", wait):
        _write(full)
        with contextlib.suppress(Exception):
            store.set(key + "/printed", "1")
    else:
        message = _gist(str(value))
        _write(f"rank {rank} failed the same way ({type(value).__name__}: {message})\n")
    with contextlib.suppress(Exception):
        store.add(_FAILURES, 1)
        deadline = time.monotonic() + linger
        while store.add(_FAILURES, 0) < heartbeat.world_size and time.monotonic() < deadline:
            time.sleep(0.05)


def _wait_for(store: Any, key: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    with contextlib.suppress(Exception):
        while not store.check([key]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True
    return False


def _stop_consequence(exc: BaseException) -> bool:
    # What a stop leaves behind: a peer gone, a collective cut short, Ctrl-C, a DataLoader worker
    # that ended with its rank. Anything else (a failed save, a bug) is still printed.
    text = str(exc)
    return (isinstance(exc, KeyboardInterrupt) or is_peer_failure(exc)
            or collective_timeout(exc) is not None or "DataLoader worker" in text)


def _report_hang(heartbeat: Any, line: str) -> None:
    """On one node: the lowest rank that waited names the ranks that never arrived; the others
    wait for its report, then leave. Stop signals are ignored meanwhile (the launcher sends
    them as soon as one rank has left)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # diagnostics must never block for long
        heartbeat.store.set_timeout(timedelta(seconds=5))
    stuck = heartbeat.not_arrived()
    if stuck is None:
        return  # no store answer: the plain line
    if not heartbeat.reporter:
        heartbeat.wait_for_report(timeout=20.0)
        quiet_exit(1)
    _write(line + _stuck_report(stuck))
    heartbeat.reported()
    os._exit(1)


def _left_early(left: Any, tb: Any) -> str:
    op, where = _collective_site(tb)
    ranks = ", ".join(f"rank {r['rank']}" + (f" (after step {r['step']})" if r.get("step")
                                                is not None else "") for r in left)
    waited = f"collective {op}" if op else "a collective"
    return (f"{ranks} exited while this rank waited in {waited}"
            f"{' (called at ' + where + ')' if where else ''}: every rank must run the same "
            "collectives; look for an early return, sys.exit or a loop that ends sooner on one "
            "rank (uneven data)")


def _stuck_report(stuck: Any) -> str:
    from .hangs import stack_or_why, stop_local

    lines = []
    for rec in stuck:
        step = rec.get("step")
        where = (f"pid {rec.get('pid', '?')} on {rec.get('host', '?')}, "
                 f"{'last finished step ' + str(step) if step is not None else 'no step finished'}")
        stack, why = stack_or_why(rec["pid"]) if rec.get("pid") else (None, "")
        lines.append(f"  rank {rec['rank']} did not arrive ({where}); "
                     + ("its Python stack, innermost first:" if stack else
                        f"({why})" if why else "its stack is not readable from here"))
        lines += [f"    {frame}" for frame in stack or []]
    killed = stop_local(stuck)  # the job has failed: do not let a stopped rank hold it
    if killed:
        lines.append(f"  stopped the stuck process(es) on this host (pid {', '.join(map(str, killed))})")
    return "".join(line + "\n" for line in lines)


def _write(text: str) -> None:
    stream = sys.__stderr__ or sys.stderr
    stream.write(text)
    stream.flush()
