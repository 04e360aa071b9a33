"""What a process's training thread is doing, seen from another thread of that process: waiting
in a collective, waiting for its DataLoader, or running; whether its Python stack moved; where it
is. The looks behind :mod:`ddpkit.faults.stall`.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import time
import traceback
from typing import Any, List, Optional

__all__ = ["Look", "stack_of", "stat_state"]

# A collective's wait, seen from Python: inside torch.distributed, DDP, or autograd (DDP's
# gradient all-reduce is waited for at the end of backward).
_WAIT_FILES = (os.sep.join(("torch", "distributed", "")), os.sep.join(("torch", "autograd", "")),
               os.sep.join(("torch", "nn", "parallel", "distributed.py")))
_LOADER_FILES = (os.sep.join(("torch", "utils", "data", "")),)
# A computation: inside torch (a module's forward, autograd's backward, an optimizer step) and
# running. One long call keeps the Python stack still (a large convolution on a busy machine).
_TORCH = os.sep.join(("", "torch", ""))
_COLLECTIVES = os.sep.join(("torch", "distributed", ""))  # busy there: spinning in a wait


def stat_state(stat: str) -> Optional[str]:
    """The kernel's state letter in a ``/proc/.../stat`` file (``R`` running, ``S`` asleep,
    ``D`` in uninterruptible I/O, ``T`` stopped; Linux), or None (gone, or not Linux).

    Example::

        stat_state(f"/proc/{os.getppid()}/stat")   # 'S'
    """
    try:
        with open(stat) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _thread_state(native_id: Optional[int]) -> Optional[str]:
    """The state letter of one thread of this process."""
    return stat_state(f"/proc/self/task/{native_id}/stat")


_STDLIB = tuple(os.path.join(os.path.realpath(sysconfig.get_paths()[k]), "")
                for k in ("stdlib", "platstdlib"))


def _first_outside_stdlib(frame: Any) -> str:
    """The file of the innermost frame not in Python's standard library (a DataLoader waits in
    ``queues.py`` and ``selectors.py`` under torch's ``dataloader.py``)."""
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith("<frozen ") or (name.startswith(_STDLIB)
                                                 and "-packages" + os.sep not in name)):
            return name
        f = f.f_back
    return frame.f_code.co_filename


def stack_of(frame: Any, frames: int = 6) -> List[str]:
    from .hangs import _frames_to_show

    summary = traceback.extract_stack(frame)[::-1]  # innermost first
    return _frames_to_show([(f.name, f.filename, _short(f.filename), f.lineno or 0)
                            for f in summary], frames)


def _short(filename: str) -> str:
    """``torch/nn/modules/module.py`` for a file under site-packages, else the file's name."""
    parts = filename.split(os.sep)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    return os.path.basename(filename)


class Look:
    """What thread ``ident`` (``native_id`` for the kernel) is doing, updated by :meth:`take`:
    ``state`` (``waiting``, ``loading``, ``computing`` inside torch, ``running``), ``moved`` (when its stack last changed),
    ``frame``, and how many looks found it waiting.

    Example::

        look = Look(threading.main_thread().ident, threading.main_thread().native_id)
        look.take(); look.state   # 'running'
    """

    def __init__(self, ident: int, native_id: Optional[int]) -> None:
        self.ident, self.native_id = ident, native_id
        self.signature: Any = None
        self.moved = time.monotonic()     # the stack last changed (or a step finished)
        self.waits = self.looks = 0        # looks that found it waiting, since the last record
        self.state = "running"
        self.frame: Any = None
        self._computing = False

    def take(self) -> None:
        frame = sys._current_frames().get(self.ident)
        self.frame = frame
        if frame is None:
            self.state = "gone"
            return
        signature = []
        f = frame
        while f is not None and len(signature) < 64:  # every frame's code and line
            signature.append((f.f_code, f.f_lineno))
            f = f.f_back
        signature = tuple(signature)
        now = time.monotonic()
        if signature != self.signature:
            self.signature, self.moved, self._computing = signature, now, False
        busy = _thread_state(self.native_id) not in ("S", "D")  # asleep: waits on something
        filename = _first_outside_stdlib(frame)
        # computing: found busy inside torch once since the stack last moved (the thread may
        # sleep a moment while torch's own threads work, in the same call)
        self._computing = self._computing or (busy and _TORCH in filename
                                              and _COLLECTIVES not in filename)
        if not busy and any(p in filename for p in _WAIT_FILES):
            self.state = "waiting"
        elif not busy and any(p in filename for p in _LOADER_FILES):
            self.state = "loading"
        elif self._computing:
            self.state = "computing"
        else:
            self.state = "running"
        self.looks += 1
        self.waits += self.state == "waiting"
