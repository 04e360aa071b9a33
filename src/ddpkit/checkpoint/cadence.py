"""When a checkpoint is due, for :class:`~ddpkit.checkpoint.checkpointer.Checkpointer`: every
``every_steps`` optimizer steps, every ``every_minutes`` (rank 0's clock decides, broadcast, so
every rank enters the collective save together), at each epoch's last batch (``every_epoch``);
with ``every_steps="auto"`` the save at step 20 of this process measures the cost and the
interval becomes Young/Daly's. After the first timed save it says what a failure costs at this
cadence (once), and warns when a stop could not end in a checkpoint within the launcher's grace
period (once).

Example::

    cadence = Cadence(every_steps=200, every_minutes=0.0, every_epoch=True, mtbf_hours=24.0)
    cadence.due(step=400, first_step=0, at_last_batch=False)   # True
"""
from __future__ import annotations

import time
from typing import Optional, Union

from ..engines import comm
from .advice import (AUTO_FIRST_SAVE, auto_cadence_line, cadence_line, grace_line,
                     restarts_allowed, young_daly_steps)

__all__ = ["Cadence"]


class Cadence:
    """When the next save is due, and the advice lines about it (each said once).

    ``first_step`` and ``started`` (the step and the monotonic time this process began
    counting from, after a resume) come from the checkpointer: steps before them were timed by
    another process.

    Example::

        cadence = Cadence("auto", 0.0, every_epoch=False, mtbf_hours=24.0)
        cadence.due(20, first_step=0, at_last_batch=False)   # True: the save that measures
    """

    def __init__(self, every_steps: Union[int, str], every_minutes: float, every_epoch: bool,
                 mtbf_hours: float) -> None:
        #: with every_steps="auto": the MTBF (s) to choose the cadence from, once measured (None)
        self.auto_mtbf: Optional[float] = 3600.0 * mtbf_hours if every_steps == "auto" else None
        self.every_steps = 0 if every_steps == "auto" else int(every_steps)
        self.every_minutes, self.every_epoch = every_minutes, every_epoch
        self.last_save_time = time.monotonic()  #: when the last save ended (or this began)
        self._cadence_said = self._grace_said = False

    def due(self, step: int, first_step: int, at_last_batch: bool) -> bool:
        """Whether ``step`` saves; the same answer on every rank (with ``every_minutes`` a
        collective: rank 0's clock decides).

        Example::

            Cadence(10, 0.0, True, 24.0).due(30, 0, at_last_batch=False)   # True
        """
        due = bool(self.every_steps) and step % self.every_steps == 0
        if self.auto_mtbf is not None:  # the save that measures the cost
            due = due or step == first_step + AUTO_FIRST_SAVE
        if self.every_epoch and at_last_batch:
            due = True
        if self.every_minutes > 0:
            # Rank 0's clock decides, so all ranks enter the (collective) save together.
            late = time.monotonic() - self.last_save_time >= 60 * self.every_minutes
            due = due or bool(comm.broadcast_object(late))
        return due

    def saved(self, began: float, measured: int, started: float) -> None:
        """A save that began at ``began`` (monotonic) just ended, ``measured`` steps after this
        process began counting at ``started``: with ``"auto"`` the first such save chooses the
        interval (rank 0's, broadcast); the cadence line (a job that restarts) and the grace
        warning are said once each.

        Example::

            began = time.monotonic(); save(); cadence.saved(began, measured=20, started=t0)
        """
        self.last_save_time = time.monotonic()
        save_s = self.last_save_time - began
        if self.auto_mtbf is not None and measured > 0:
            self._choose((began - started) / measured, save_s)
        per_step = (began - started) / max(1, measured)
        if not self._cadence_said and measured > 0:   # said once, after the first timed save
            self._cadence_said = True
            if restarts_allowed():
                comm.print0(cadence_line(self.every_steps, self.every_minutes, per_step, save_s))
        # every timed save until said: a disk can slow down after the first
        warning = grace_line(per_step, save_s) if not self._grace_said and measured > 0 else None
        if warning:
            self._grace_said = True
            comm.print0(warning)

    def _choose(self, step_s: float, save_s: float) -> None:
        steps = comm.broadcast_object(young_daly_steps(save_s, step_s, self.auto_mtbf))  # rank 0's
        comm.print0(auto_cadence_line(steps, step_s, save_s, self.auto_mtbf))
        self.every_steps, self.auto_mtbf, self._cadence_said = int(steps), None, True
