"""Naming what the agent does after a failure: which rank failed first and how, and the line
each time torchrun's agent restarts the group (a failed rank, a lost peer and its step, or a node
waiting to join an elastic job). Used by :mod:`.torchrun` around the in-process agent.
"""
from __future__ import annotations

import contextlib
import json
import signal
import sys
from typing import Any, Callable, Iterator, Optional, Tuple

from ..faults.alike import EVERY_RANK
from ..faults.crash import PEER_LOSS_SUFFIX
from ..faults.stops import STOP_SIGNALS, signal_name
from . import watchdog

__all__ = ["how", "said_in_one_line", "first_failure", "left_early", "used_up",
           "naming_restarts"]


def how(failure: Any, restarting: bool = False) -> str:
    """How a worker failed, and whether its own error is above (torchrun's error file says).
    ``restarting``: a rank that only lost a peer has said nothing (ddpkit.faults.crash), so say so."""
    if isinstance(failure.error_file_data.get("message"), dict):
        return f"exit code {failure.exitcode}; its error is printed above"
    if failure.exitcode == -signal.SIGABRT:  # aborted by native code, which may have said why
        return ("killed by SIGABRT: a crash in native code; its own message, if it printed one, "
                "is above (gloo's 'collective mismatch': the ranks called different collectives, "
                "e.g. one under `if rank == 0:`)")
    if failure.exitcode < 0:
        return (f"killed by {signal_name(-failure.exitcode)}; it printed no error: killed from "
                "outside, out of memory, or a crash in native code")
    if restarting:
        return f"exit code {failure.exitcode}; it lost a peer on another node, or see its output"
    return f"exit code {failure.exitcode}; see its output above"


def said_in_one_line(failure: Any) -> bool:
    """Whether the failed rank's own ``error:`` line already says everything: a ddpkit error
    (exit code 2, recorded in torchrun's error file), or an error every rank raised alike
    (marked there by :mod:`ddpkit.faults.alike`), needs no second line and no restart.

    Example::

        if not said_in_one_line(failure): print(f"ddpkit run: rank 0 failed ({how(failure)})")
    """
    message = failure.error_file_data.get("message")
    if not isinstance(message, dict):
        return False
    extra = message.get("extraInfo")
    return failure.exitcode == 2 or (isinstance(extra, dict) and extra.get("ddpkit") == EVERY_RANK)


def first_failure(failures: dict) -> Tuple[int, Any]:
    """Ranks that recorded an error (the earliest) beat ranks killed by a signal from outside
    (``kill -9``, the OOM killer, a crash in native code), which beat the rest: ranks that lost
    a peer, or that the agent itself stopped with SIGTERM once one had failed. Among equals, the
    order the agent saw them in (its dict keeps it; timestamps are whole seconds)."""
    def order(item: Tuple[int, Any]) -> Tuple[int, float]:
        failure = item[1]
        if isinstance(failure.error_file_data.get("message"), dict):
            return 0, failure.timestamp
        return (1 if failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM else 2), 0.0

    return min(failures.items(), key=order)  # min keeps the first of equals


def left_early(agent: Any, group: Any, failures: dict) -> Optional[str]:
    """``rank 0 exited (code 0) before the job ended; rank 1 then failed waiting for it ...``
    when this node's ranks that failed recorded no error of their own (they lost a peer) and a
    rank had left with exit code 0 (torchrun counts that a success); else None.

    Example::

        left_early(agent, group, {1: failure})   # 'rank 0 exited (code 0) before the job ...'
    """
    if not failures or any(isinstance(f.error_file_data.get("message"), dict)
                           for f in failures.values()):
        return None  # a rank failed of its own: its error is the cause
    left = sorted(group.workers[local].global_rank
                  for local, (_pid, code) in watchdog.workers(getattr(agent, "_pcontext", None))
                  .items() if code == 0)
    if not left:
        return None
    def ranks(numbers: Any) -> str:
        return ", ".join(f"rank {r}" for r in sorted(numbers))
    return (f"{ranks(left)} exited (code 0) before the job ended; {ranks(failures)} then failed "
            "waiting for it (an early return, sys.exit or os._exit on one rank: every rank must "
            "run to the end)")


def used_up(count: int, note: Optional[Callable[[], str]] = None) -> str:
    """For the last line of a job that failed after ``count`` restarts (none: ""): that they are
    used up, then ``note()``, how to continue (the command that resumes).

    Example::

        used_up(1)   # ' after 1 restart (--max-restarts 1, all used)'
    """
    if count <= 0:
        return ""
    said = f" after {count} restart{'s' if count > 1 else ''} (--max-restarts {count}, all used)"
    return said + (note() if note is not None else "")


def _say_restart(agent: Any, group: Any, failed: Any) -> None:
    seen = getattr(agent, "_ddpkit_seen", None)
    if seen is not None and seen.state != failed and group.group_rank == 0:
        # Healthy workers restarted: torchrun's agent saw a node waiting to join (elastic).
        print("ddpkit run: a node is waiting to join: every rank checkpoints at its next step "
              "and the group restarts with it", file=sys.stderr, flush=True)
        return
    if seen is None or seen.state != failed or not seen.failures:
        return
    rank, failure = first_failure(seen.failures)
    most = group.spec.max_restarts  # the agent has counted this restart already
    left = getattr(agent, "_remaining_restarts", None)
    count = f" (restart {most - left} of {most})" if isinstance(left, int) else ""
    what = (_peer_loss(failure, _error_file(agent, failure)) or _stopped_with_group(failure)
            or f"failed ({how(failure, restarting=True)})")
    early = getattr(agent, "_ddpkit_left_early", None)
    said = early or f"rank {rank} {what}"
    print(f"ddpkit run: {said}; restarting every rank{count}", file=sys.stderr, flush=True)


def _stopped_with_group(failure: Any) -> Optional[str]:
    """128 + a stop signal is ddpkit's agreed stop (ddpkit.faults.stops): this node's agent got no
    signal (it is restarting), so the signal reached a rank on another node, and every rank
    saved and left with it. None for any other failure."""
    signum = failure.exitcode - 128
    if signum not in STOP_SIGNALS or isinstance(failure.error_file_data.get("message"), dict):
        return None
    return (f"stopped with the group (exit code {failure.exitcode}): {signal_name(signum)} "
            "reached a rank on another node (an eviction, a preemption) and every rank saved "
            "a checkpoint")


def _error_file(agent: Any, failure: Any) -> Optional[str]:
    # The failure forgets the path when the rank wrote no error file: the agent's workers know it.
    files = getattr(getattr(agent, "_pcontext", None), "error_files", None) or {}
    return files.get(failure.local_rank)


def _peer_loss(failure: Any, error_file: Optional[str]) -> Optional[str]:
    """``lost a peer at 10.0.0.3 after step 6 ...`` when the rank said so (ddpkit.faults.crash, beside
    its ``error_file``), else None."""
    if error_file is None or isinstance(failure.error_file_data.get("message"), dict):
        return None  # it failed itself: its own error is printed
    try:
        with open(error_file + PEER_LOSS_SUFFIX) as f:
            note = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    step = f" after step {note['step']}" if note.get("step") is not None else ""
    peer = f" at {note['peer']}" if note.get("peer") else ""
    return (f"lost a peer{peer}{step} (exit code {failure.exitcode}): a node is gone or cut "
            "off, or a process on it died")


@contextlib.contextmanager
def naming_restarts() -> Iterator[dict]:
    """While the agent runs: one line each time it restarts the group after a failure, naming
    the rank and how it failed (the agent restarts silently with its logs quiet). The agent
    does not hand the failure to its restart, so its last observation is kept on the agent.
    A rank's ddpkit error (one ``error:`` line, exit code 2: bad input), or an error every rank
    raised alike, is not restarted: it would only be printed again. Yields a dict whose
    ``"left_early"`` is the last failure's :func:`left_early` line (or None)."""
    said: dict = {"left_early": None}
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        monitor, restart = LocalElasticAgent._monitor_workers, SimpleElasticAgent._restart_workers
    except (ImportError, AttributeError):  # another torch: restarts just go unnamed
        yield said
        return

    def monitored(agent: Any, group: Any) -> Any:
        agent._ddpkit_seen = seen = monitor(agent, group)
        if seen.state == WorkerState.FAILED:
            with contextlib.suppress(Exception):  # naming it must never stop the agent
                said["left_early"] = agent._ddpkit_left_early = left_early(
                    agent, group, seen.failures or {})
        if seen.state == WorkerState.FAILED and any(
                said_in_one_line(f) for f in (seen.failures or {}).values()):
            agent._remaining_restarts = 0  # a ddpkit error (bad input) would only come back
        return seen

    def restarted(agent: Any, group: Any) -> None:
        with contextlib.suppress(Exception):  # naming it must never stop the restart itself
            _say_restart(agent, group, WorkerState.FAILED)
        restart(agent, group)

    LocalElasticAgent._monitor_workers, SimpleElasticAgent._restart_workers = monitored, restarted
    try:
        yield said
    finally:
        LocalElasticAgent._monitor_workers, SimpleElasticAgent._restart_workers = monitor, restart
