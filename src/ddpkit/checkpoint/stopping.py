"""How a checkpointer stops on SIGTERM / SIGUSR1: at which steps every rank asks whether a
signal came (every step at first, then about every 0.25 s by rank 0's measure of the step
time), whether the stop's checkpoint is the last save (complete after the signal: every rank
votes) or a new one, and the line it ends with.

Example::

    questions = StopQuestions()
    if questions.due(step, first_step, started, installed=rt.stops.installed):
        signum = rt.stops.poll(rt.engine)
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from ..engines import comm
from ..faults.stops import signal_name
from .position import save_outlived_signal

__all__ = ["StopQuestions", "last_save_ends_stop", "stop_line", "STOP_CALIBRATION"]

STOP_CALIBRATION = 20  # the optimizer step at which the ranks settle how often to ask


class StopQuestions:
    """The steps at which every rank asks about a stop: the same on every rank, so all stop
    after the same one. The question costs ~0.3-0.4 ms on gloo (a side group of CPU numbers,
    no device sync): every step until step ``first_step + 20``, then about every 0.25 s.

    Example::

        q = StopQuestions()
        [q.due(s, 0, time.monotonic(), installed=False) for s in (1, 2)]   # [True, True]
    """

    def __init__(self) -> None:
        self.every = 1  #: ask every this many steps (settled at the calibration step)

    def due(self, step: int, first_step: int, started: float, installed: bool) -> bool:
        """Whether every rank asks after ``step`` (at the calibration step with handlers
        ``installed``: a collective that settles the interval by rank 0's step time, measured
        since ``started``, the time of ``first_step``).

        Example::

            StopQuestions().due(7, first_step=0, started=t0, installed=True)   # True
        """
        if step == first_step + STOP_CALIBRATION and installed:
            per_step = (time.monotonic() - started) / max(1, step - first_step)
            self.every = int(comm.broadcast_object(max(1, round(0.25 / per_step))))
        return step % self.every == 0


def last_save_ends_stop(received_at: Optional[float], saved_at: Optional[float]) -> bool:
    """Whether the stop ends with the last save rather than a new one (every rank votes, a
    collective): a save complete after the signal came (under way when it came, say) is the
    stop's; a second one, on a slow disk, could outlast the launcher's grace period.

    Example::

        last_save_ends_stop(rt.stops.received_at, saved_at=None)   # False: nothing saved yet
    """
    return bool(comm.reduce(int(save_outlived_signal(received_at, saved_at)), "min"))


def stop_line(signum: int, step: int, where: str, saved: Optional[Path],
              saved_step: Optional[int], directory: Optional[Path],
              received_at: Optional[float]) -> str:
    """The line a stop ends with: the signal, the step and position, the checkpoint (its step
    when it holds an earlier one) and how long after the signal it was saved.

    Example::

        stop_line(15, 9, " (epoch 2)", Path("ckpt/ckpt-000000009.pt"), 9, Path("ckpt"), t)
        # 'stopped by SIGTERM at step 9 (epoch 2): checkpoint ckpt/... saved 1.2 s after the signal'
    """
    # another rank may have asked first: this one got its own signal later, or none
    when = (f"{max(0.0, time.monotonic() - received_at):.1f} s after the signal"
            if received_at is not None else "(the signal reached another rank)")
    held = f" (step {saved_step})" if saved_step != step else ""
    what = (f"checkpoint {saved}{held} saved {when}" if saved else
            "nothing saved" if directory is None else
            f"checkpoint saved in {directory}")
    return f"stopped by {signal_name(signum)} at step {step}{where}: {what}"
