"""A run directory that already holds a run (its ``results.json``, its checkpoints): refused to
a new ``ddpkit train`` unless it resumes that run or deletes it first (``--overwrite``).

Without this a second run overwrote ``results.json``, appended to ``metrics.jsonl`` and mixed
its checkpoints with the first run's, so ``--resume auto`` could take either.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import List, Optional

from ..checkpoint.files import list_checkpoints
from ..base.errors import ConfigError

__all__ = ["claim_output", "RUN_FILES"]

#: What ``ddpkit train`` writes into its ``--output`` (the lock aside): all that ``--overwrite``
#: deletes.
RUN_FILES = ("checkpoints", "config.json", "metrics.jsonl", "results.json", "results.json.tmp",
             "tensorboard")


def claim_output(directory: str, resume: Optional[str], overwrite: bool) -> None:
    """Take ``directory`` for a run: as it is when the run resumes (``resume``) or the directory
    holds no earlier run's results or checkpoints; after deleting that run's files with
    ``overwrite``; otherwise a :class:`ConfigError` naming what is there and the three ways on.
    Call it holding the directory's lock (:func:`ddpkit.job.rundir.hold_run_dir`).

    Example::

        claim_output("runs/demo", resume=None, overwrite=False)   # ConfigError if it ran before
    """
    if overwrite and resume:
        raise ConfigError("--overwrite starts the run afresh and --resume continues it: give "
                          "one of them")
    if resume:
        return
    held = _earlier_run(directory)
    if held is None:
        return
    if not overwrite:
        raise ConfigError(f"--output {directory} holds {held}: continue it with --resume auto, "
                          "give this run another --output, or add --overwrite to delete that "
                          "run's files first")
    _delete_run(directory)


def _earlier_run(directory: str) -> Optional[str]:
    """What an earlier run left in ``directory``, in words, or None when it left nothing to lose
    (no results, no checkpoint: a run that stopped before saving may be started again)."""
    finished = os.path.isfile(os.path.join(directory, "results.json"))
    saved = list_checkpoints(os.path.join(directory, "checkpoints"))
    if not finished and not saved:
        return None
    parts: List[str] = ["results.json"] if finished else []
    if saved:
        parts.append(f"{len(saved)} checkpoint{'s' if len(saved) > 1 else ''}, the newest "
                     f"{saved[-1].name}")
    return f"{'a finished' if finished else 'an unfinished'} run ({', '.join(parts)})"


def _delete_run(directory: str) -> None:
    deleted = []
    for name in RUN_FILES:
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
            else:
                continue
        except OSError as exc:
            raise ConfigError(f"--overwrite: cannot delete {path} ({exc.strerror or exc}); "
                              "delete it by hand, or give this run another --output") from None
        deleted.append(name + ("/" if name in ("checkpoints", "tensorboard") else ""))
    print(f"note: --overwrite: deleted the earlier run in {directory} ({', '.join(deleted)})",
          file=sys.stderr, flush=True)
