"""Where a run stands, in the words of the stop and resume lines (epochs counted from 1), and
which save a stop ends with.

Example::

    where({"epoch": 3, "samples_done": 0}, last_batch_out=False)   # ' (end of epoch 3)'
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["where", "save_outlived_signal"]


def where(loader_state: Optional[Mapping[str, Any]], last_batch_out: bool,
          mid: str = "") -> str:
    """`` (epoch 2)``, `` (epoch 2, mid-epoch)`` (``mid`` added inside an epoch) or
    `` (end of epoch 3)``: after an epoch's last batch the run is not in the next epoch, which
    a 3-epoch run never reaches (once said "epoch 4"). ``last_batch_out``: every batch of the
    epoch was handed out, its end (evaluation, schedule) may still be to come. Empty without
    a loader (the checkpoint does not know the epoch).

    Example::

        where({"epoch": 1, "samples_done": 64}, False, ", mid-epoch")   # ' (epoch 2, mid-epoch)'
    """
    if loader_state is None:
        return ""
    epoch, done = int(loader_state["epoch"]), int(loader_state["samples_done"])
    if done == 0:
        return f" (end of epoch {epoch})" if epoch > 0 else " (epoch 1)"
    if last_batch_out:
        return f" (end of epoch {epoch + 1})"
    return f" (epoch {epoch + 1}{mid})"


def save_outlived_signal(received_at: Optional[float], saved_at: Optional[float]) -> bool:
    """This rank's vote on ending a stop with the last save instead of a new one: yes when that
    save was complete (staged, with ``async_save``) after this rank's signal came, so it holds a
    state from after it (it was under way, or began after it); yes without a signal here (the
    ranks that got it decide); no before any save. A second save of a slow disk can outlast
    the launcher's grace period, killing the ranks before any stop line.

    Example::

        save_outlived_signal(received_at=100.0, saved_at=104.5)   # True: it ended after it
    """
    if saved_at is None:
        return False
    return received_at is None or received_at <= saved_at
