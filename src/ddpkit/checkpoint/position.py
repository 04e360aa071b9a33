"""Where a run stands, in the words of the stop and resume lines (epochs counted from 1).

Example::

    where({"epoch": 3, "samples_done": 0}, last_batch_out=False)   # ' (end of epoch 3)'
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["where"]


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

