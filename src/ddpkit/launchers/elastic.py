"""Elastic membership (``--nnodes MIN:MAX``) as the user sees it: one line from the first node
each time torchrun's agent forms a new group, saying who left or joined and how many go on.

torchrun's c10d rendezvous changes membership but only logs it at INFO (quiet in ``ddpkit
run``). After each rendezvous round every node's agent writes its name into that round's store
and reads the others'; the node with group rank 0 compares them with the previous round's.
The workers then resume from the newest checkpoint at the new world size (:mod:`ddpkit.checkpoint.checkpointer`).
Also a node left alone in a newer round (:func:`stranded`) counts as waiting to join.
"""
from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator, List, Optional, Sequence, Tuple

__all__ = ["membership_line", "missing_line", "tracking_members", "counting_stranded_nodes",
           "stranded", "Members", "MEMBER_KEY"]

#: Each node's name in a rendezvous round's store: ``ddpkit/member/<group rank>``.
MEMBER_KEY = "ddpkit/member/"
_READ_TIMEOUT_S = 120.0
_POLL_S = 0.25


def membership_line(before: Optional[Sequence[str]], now: Sequence[str], spec: str) -> str:
    """The line for a new group: who left, who joined, who goes on (``spec``: ``--nnodes``).

    Example::

        membership_line(["a", "b", "c"], ["a", "b"], "2:3")
        # 'node c left; 2 nodes go on (a, b) of --nnodes 2:3'
    """
    names = ", ".join(now)
    if before is None:
        return f"{len(now)} node{'s' if len(now) != 1 else ''} joined (--nnodes {spec}): {names}"
    left = [n for n in before if n not in now]
    joined = [n for n in now if n not in before]
    said = []
    if left:
        said.append(f"node{'s' if len(left) > 1 else ''} {', '.join(left)} left")
    if joined:
        said.append(f"node{'s' if len(joined) > 1 else ''} {', '.join(joined)} joined")
    change = "; ".join(said) if said else "the same nodes meet again"
    goes = f"{len(now)} nodes go on" if len(now) != 1 else "1 node goes on"
    return f"{change}; {goes} ({names}) of --nnodes {spec}"


def missing_line(last: Optional[Sequence[str]], me: str, spec: str) -> str:
    """What to add when too few nodes came back: the last group, and that only this one is known
    to be here.

    Example::

        missing_line(["a", "b", "c"], "a", "2:3")
        # 'the last group was a, b, c: fewer than 2 of them came back (this node is a) ...'
    """
    least = spec.split(":")[0]
    if not last:
        return f"need {least} of --nnodes {spec}"
    return (f"the last group was {', '.join(last)}: fewer than {least} of them came back (this "
            f"node is {me}; need {least} of --nnodes {spec}); its checkpoints are intact: start "
            "the missing nodes with the same command, or lower MIN")


class Members:
    """The nodes of the newest group this agent was part of (``last``; None before the first)."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.last: Optional[List[str]] = None


def _node_name(local_addr: Optional[str]) -> str:
    host = socket.gethostname()
    return f"{host} ({local_addr})" if local_addr and local_addr != host else host


def _members(group: Any, me: str, before: Optional[List[str]],
             timeout: float = _READ_TIMEOUT_S) -> List[Any]:
    """Every node's (name, previous group) in this round, by group rank.

    Polled, never one long ``store.wait``: the round's store shares its TCP client with the
    rendezvous, which takes one request at a time, and a wait held it for as long as the last
    name took to come; the node's heartbeats queued behind it, so on a loaded machine its
    peers took it for dead and dropped it from the rendezvous (a node that came later was
    then left alone in a round of its own, unseen)."""
    store = group.store
    store.set(f"{MEMBER_KEY}{group.group_rank}", json.dumps([me, before]))
    keys = [f"{MEMBER_KEY}{r}" for r in range(group.group_world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every node named itself within {timeout:.0f} s")
        time.sleep(_POLL_S)
    return [json.loads(store.get(key).decode()) for key in keys]


def _teller(said: List[Any]) -> Tuple[int, Optional[List[str]]]:
    """Who says the line, and against which group: the first node (by group rank) that was in
    a group before, or rank 0 when none was (a newcomer knows nothing to compare with)."""
    for rank, (_, before) in enumerate(said):
        if before is not None:
            return rank, before
    return 0, None


@contextlib.contextmanager
def tracking_members(spec: str, local_addr: Optional[str] = None) -> Iterator[Members]:
    """While torchrun's agent runs here: after each rendezvous, the membership line (first node
    only, on stderr). Best effort: a store that does not answer leaves the round unnamed.

    Example::

        with tracking_members("2:3", "10.213.0.1") as members:
            torchrun(args)   # members.last: the newest group's nodes
    """
    members = Members(_node_name(local_addr))
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        original = SimpleElasticAgent._rendezvous
    except (ImportError, AttributeError):  # another torch: rounds just go unnamed
        yield members
        return

    def name_round(group: Any, previous: Optional[threading.Thread]) -> None:
        if previous is not None:
            previous.join()  # rounds named in order: each compares with the one before
        with contextlib.suppress(Exception):  # naming it must never stop the job
            said = _members(group, members.me, members.last)
            now = [name for name, _ in said]
            members.last = now
            teller, before = _teller(said)
            if group.group_rank == teller and (before is None or set(now) != set(before)):
                sys.stderr.write(f"ddpkit run: {membership_line(before, now, spec)}\n")
                sys.stderr.flush()

    naming: List[Optional[threading.Thread]] = [None]

    def rendezvous(agent: Any, group: Any) -> None:
        original(agent, group)
        # Beside the agent, which starts the workers meanwhile: on a loaded machine another
        # node may write its name many seconds later (a CI run missed the line at a 15 s wait).
        round_ = SimpleNamespace(store=group.store, group_rank=group.group_rank,
                                 group_world_size=group.group_world_size)
        naming[0] = threading.Thread(target=name_round, args=(round_, naming[0]), daemon=True,
                                     name="ddpkit-members")
        naming[0].start()

    SimpleElasticAgent._rendezvous = rendezvous
    try:
        yield members
    finally:
        SimpleElasticAgent._rendezvous = original
        if naming[0] is not None:
            naming[0].join(timeout=2.0)  # long done in a real job; a test's rounds come fast


def stranded(state: Any, joined: Optional[int]) -> int:
    """Nodes gathered in an open rendezvous round newer than the one this node joined
    (``joined``): nodes the group does not see waiting, though they wait for it.

    torchrun's c10d rendezvous drops a node whose heartbeats stop for a while (3 missed) from
    the round's participants and wait list. If every member of a running group was dropped
    so (a loaded machine, a store call that held the client), the round counts as empty and a
    node arriving then opens the next round alone: it is in no wait list, so the group's
    ``num_nodes_waiting`` stays 0 and the node waits out its join timeout, silent.

    Example::

        stranded(state, joined=0)   # 1: round 1 is open with one node in it
    """
    if joined is None or state is None or getattr(state, "complete", True):
        return 0
    if getattr(state, "round", -1) <= joined:
        return 0
    return len(getattr(state, "participants", ()) or ())


@contextlib.contextmanager
def counting_stranded_nodes() -> Iterator[None]:
    """While torchrun's agent runs here: nodes gathered in a newer open round count as nodes
    waiting to join (:func:`stranded`), so the group restarts and takes them in, as it does
    for a node in the wait list.

    Example::

        with counting_stranded_nodes():
            torchrun(args)
    """
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import \
            DynamicRendezvousHandler as Handler
        joining, waiting = Handler.next_rendezvous, Handler.num_nodes_waiting
    except (ImportError, AttributeError):  # another torch: as torchrun does
        yield
        return

    def next_rendezvous(handler: Any) -> Any:
        info = joining(handler)
        with contextlib.suppress(AttributeError):
            handler._ddpkit_round = handler._state_holder.state.round
        return info

    def num_nodes_waiting(handler: Any) -> int:
        count = waiting(handler)  # synced the state (or served it from its 1 s cache)
        if count:
            return count
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        return stranded(state, getattr(handler, "_ddpkit_round", None))

    Handler.next_rendezvous, Handler.num_nodes_waiting = next_rendezvous, num_nodes_waiting
    try:
        yield
    finally:
        Handler.next_rendezvous, Handler.num_nodes_waiting = joining, waiting
