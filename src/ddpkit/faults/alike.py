"""An error every rank raised alike (a missing file, a bug on a path every rank takes): what it
is, and one line for it where a restart would only meet it again. Used by :mod:`.crash`.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
import time
from datetime import timedelta
import traceback
from typing import Any

__all__ = ["failure_digest", "where", "said_for_every_rank", "said_by_rank_0", "heard",
           "EVERY_RANK"]

#: The mark, in torchrun's error file, of an error every rank raised alike: not restarted.
EVERY_RANK = "every rank"
_ALIKE = "ddpkit/alike/{digest}"   # how many ranks raised this error, before any printed it
_SAID = "ddpkit/said/{digest}"     # rank 0 printed this one-line error
# What differs between ranks that hit the same bug: rank numbers, pids, devices, addresses.
_RANK_SPECIFIC = ((re.compile(r"(rank|pid)[\s=:#_-]{0,2}\d+", re.I), r"\1 N"),
                  (re.compile(r"(cuda|xpu|mps|gpu|device)[\s=:#_-]{0,2}\d+", re.I), r"\1 N"),
                  (re.compile(r"0x[0-9a-f]+", re.I), "0x?"),
                  (re.compile(r"\d{1,3}(\.\d{1,3}){3}(:\d+)?"), "ADDR"))


def failure_digest(text: str) -> str:
    """A digest of a traceback that is the same on every rank that failed the same way.

    Example::

        failure_digest("bad batch on rank 1") == failure_digest("bad batch on rank 0")   # True
    """
    for pattern, replacement in _RANK_SPECIFIC:
        text = pattern.sub(replacement, text)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def where(tb: Any) -> str:
    """The innermost frame of the user's own code in a traceback (not Python's library, an
    installed package or ddpkit), as ``file:line, in function``; the innermost frame if none.

    Example::

        where(exc.__traceback__)   # 'train.py:4, in load'
    """
    frames = traceback.extract_tb(tb)
    if not frames:
        return "?"
    library = tuple(p for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                sysconfig.get_paths()["platlib"],
                                os.path.dirname(os.path.dirname(__file__))} if p)
    own = [f for f in frames if not os.path.abspath(f.filename).startswith(library)]
    frame = (own or frames)[-1]
    return f"{frame.filename}:{frame.lineno}, in {frame.name}"


def said_for_every_rank(store: Any, world_size: int, rank: int, line: str, text: str,
                        wait: float = 2.0) -> bool:
    """Whether every rank raised this error (``text``, its traceback) within ``wait`` seconds;
    then the first of them has written ``line`` and the others have waited for it (bounded).
    False (nothing written) when a rank did not, or the store did not answer.

    Example::

        said_for_every_rank(heartbeat.store, 2, rank, "error: ...\\n", traceback_text)
    """
    try:
        key = _ALIKE.format(digest=failure_digest(text))
        first = store.add(key, 1) == 1
        deadline = time.monotonic() + wait
        while store.add(key, 0) < world_size:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        if first:
            sys.__stderr__.write(line)
            sys.__stderr__.flush()
            store.set(key + "/printed", "1")
        else:  # the launcher stops every rank once one has left: let the first one say it
            while not store.check([key + "/printed"]) and time.monotonic() < deadline + wait:
                time.sleep(0.05)
        return True
    except Exception:  # noqa: BLE001 - no answer from the store: the usual report instead
        return False


def said_by_rank_0(store: Any, rank: int, line: str, wait: float = 3.0) -> bool:
    """A one-line error (a bad input, found alike on every rank): rank 0 marks it said and
    prints it (False here); another rank waits up to ``wait`` s for rank 0 to have said the same
    line (True: say nothing). Where no launcher stops the other ranks once rank 0 has failed
    (Lightning Fabric's, a user's own), each would print it again. False without a store.

    Example::

        if not said_by_rank_0(heartbeat.store, rank, str(error)):
            print(f"[rank {rank}] error: {error}")
    """
    if store is None:
        return False
    try:
        store.set_timeout(timedelta(seconds=5))
        key = _SAID.format(digest=failure_digest(line))
        if rank == 0:
            store.set(key, "1")
            return False
        deadline = time.monotonic() + wait
        while not store.check([key]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        store.add(key + "/quiet", 1)  # rank 0 waits for this before it leaves (and its store)
        return True
    except Exception:  # noqa: BLE001 - no answer: the rank says it itself
        return False


def heard(store: Any, world_size: int, line: str, wait: float = 3.0) -> None:
    """Rank 0, after saying ``line``: wait (at most ``wait`` s) until the ranks that failed
    alike have seen it said, so that a store rank 0 hosts outlives their question.

    Example::

        heard(heartbeat.store, 2, str(error))
    """
    try:
        key = _SAID.format(digest=failure_digest(line)) + "/quiet"
        deadline = time.monotonic() + wait
        while store.add(key, 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - no answer: nothing to wait for
        pass
