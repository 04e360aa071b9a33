"""What a checkpointer tells the user about surviving failures: a resume on another number of
processes (an elastic job that shrank or grew: the global batch kept and how it is split now,
what differs), what a failure costs at this checkpoint cadence, and whether a stop can end in a
checkpoint within the launcher's window: the lines it prints, apart from its mechanics
(:mod:`.checkpointer`).
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from ..base.wrap import unwrap
from ..data.batch import Batch

__all__ = ["world_change_line", "cadence_line", "grace_line", "restarts_allowed",
           "AUTO_FIRST_SAVE", "young_daly_steps", "auto_cadence_line"]

#: With ``every_steps="auto"``: the step (after the run's first) whose save measures the cost.
AUTO_FIRST_SAVE = 20


def restarts_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the launcher restarts this job after a failure (torchrun's ``--max-restarts``)."""
    try:
        return int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    except ValueError:
        return False


def grace_line(step_s: float, save_s: float,
               environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """A warning when a stop cannot end in a checkpoint: after SIGTERM (an eviction, a
    preemption) the ranks finish the step under way and the next at most, then save; the
    launcher kills them after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` s (set by ``ddpkit k8s`` and
    ``ddpkit slurm`` from the grace period; torchrun's agent waits 30 s without it). None when
    it fits, or when no launcher runs this process.

    Example::

        grace_line(20.0, 15.0, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"})   # 'a stop ... needs 55 s'
    """
    why = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    try:
        window = float(environ[why])
    except KeyError:
        if "TORCHELASTIC_RUN_ID" not in environ:
            return None
        window, why = 30.0, "torchrun's default; TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets it"
    except ValueError:
        return None
    need = 2 * step_s + save_s
    if need <= window:
        return None
    grace = int(math.ceil(2 * need)) + 10
    return (f"warning: a stop (SIGTERM: an eviction, a preemption) needs up to {need:.1f} s here "
            f"(the step under way and the next, {step_s:.2f} s each, then a checkpoint save, "
            f"{save_s:.2f} s), but the launcher kills the workers {window:g} s after it "
            f"({why}): they would die before the checkpoint is written; give the job a longer "
            f"grace period (ddpkit k8s --grace-period {grace}, ddpkit slurm --requeue-grace "
            f"{grace + 20}, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace - 10} for ddpkit run)")


def cadence_line(every_steps: int, every_minutes: float, step_s: float, save_s: float) -> str:
    """What a failure costs at this checkpoint cadence: half the interval of work on average,
    beside the measured save time (said once, after the first save of a job that restarts).

    Example::

        cadence_line(0, 5.0, 0.2, 0.4)
        # 'checkpoints every 5 min: a failure loses 2.5 min of work on average (...); ...'
    """
    intervals = []
    if every_minutes > 0:
        intervals.append((60.0 * every_minutes, f"{every_minutes:g} min"))
    if every_steps:
        intervals.append((every_steps * step_s, f"{every_steps} steps"))
    if not intervals:
        return (f"a checkpoint took {save_s:.2f} s to save; only epoch ends save: a failure "
                "loses half an epoch of work on average (--ckpt-every-minutes saves more often)")
    seconds, said = min(intervals)
    return (f"checkpoints every {said}: a failure loses {_duration(seconds / 2)} of work on "
            f"average, plus the restart; a checkpoint took {save_s:.2f} s to save "
            f"({100 * save_s / max(seconds, 1e-9):.1f}% of the interval)")


def young_daly_steps(save_s: float, step_s: float, mtbf_s: float) -> int:
    """Optimizer steps between checkpoints that lose the least time to saves and failures
    together: Young/Daly's interval sqrt(2 x save time x mean time between failures).

    Example::

        young_daly_steps(0.5, 0.1, 24 * 3600)   # 2939: one save every ~4.9 min
    """
    return max(1, round(math.sqrt(2 * save_s * mtbf_s) / max(step_s, 1e-9)))


def auto_cadence_line(steps: int, step_s: float, save_s: float, mtbf_s: float) -> str:
    """What ``every_steps="auto"`` chose and what it costs: saves and lost work as shares of
    the run's time.

    Example::

        auto_cadence_line(2939, 0.1, 0.5, 24 * 3600)
        # 'checkpoints every 2939 steps (4.9 min), chosen ...'
    """
    interval = steps * step_s
    return (f"checkpoints every {steps} steps ({_duration(interval)}), chosen from a save that "
            f"blocks {save_s:.2f} s and a failure every {mtbf_s / 3600:g} h (Young/Daly, "
            f"sqrt(2 x save x MTBF)): saves take {100 * save_s / interval:.1f}% of the time; a "
            f"failure loses {_duration(interval / 2)} of work on average, plus the restart "
            f"({100 * interval / 2 / mtbf_s:.2f}% of the time)")


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def world_change_line(before: Any, now: int, step: int, loader: Any = None,
                      model: Any = None, saved_batch: Any = None,
                      unmapped: Sequence[str] = ()) -> str:
    """The line for a checkpoint resumed on another number of processes: the step, how the
    global batch is split now (``loader.batch``) and what it was (``saved_batch``: the
    checkpoint's :class:`~ddpkit.data.batch.Batch`; an int from a checkpoint written before it
    recorded one: a micro-batch x its world size, taken with this run's accumulation steps), and
    what is not the same (random streams, ``unmapped``: the extras saved per rank, BatchNorm).

    Example::

        world_change_line(3, 2, 14)
        # 'resumed at step 14 on 2 processes (the checkpoint was written by 3): ...'
    """
    said = [f"resumed at step {step} on {now} processes (the checkpoint was written by {before})"]
    batch = _batch_now(loader, now)
    if batch is not None:
        total, per_rank = batch.global_batch, batch.per_rank
        if isinstance(saved_batch, Batch):
            saved, split = saved_batch.global_batch, saved_batch.per_rank
        else:  # older checkpoints: a micro-batch x the world size, or nothing
            saved = saved_batch * batch.accum_steps if isinstance(saved_batch, int) else total
            split = saved // before if isinstance(before, int) and before and \
                saved % before == 0 else None
        micro = (f" in {batch.accum_steps} micro-batches of {batch.micro_batch}"
                 if batch.accum_steps > 1 else "")
        if saved == total:
            said.append(f"each batch still spans {total} samples: {per_rank} a rank{micro}"
                        f"{'' if split is None else f', was {split}'}; the epoch goes on with "
                        "every sample once")
        else:
            said.append(f"each batch now spans {total} samples ({per_rank} a rank{micro}), was "
                        f"{saved}{'' if split is None else f' ({split} a rank)'}; the epoch goes "
                        "on with every sample once")
    said.append("each rank's random stream starts afresh")
    if unmapped:
        many = len(unmapped) > 1
        said.append(f"extra{'s' if many else ''} {', '.join(map(repr, unmapped))} differed per "
                    f"rank when saved on {before} ranks: each rank starts "
                    f"{'them from their initial values' if many else 'it from its initial value'}"
                    " (given in extra=)")
    norms = _unsynced_batchnorm(model)
    if norms:
        said.append(f"warning: {norms} BatchNorm layer{'s' if norms > 1 else ''} normalise each "
                    "rank's batch alone, so results depend on the world size (SyncBatchNorm "
                    "on GPUs: --sync-bn, or rt.wrap(model, sync_bn=True))")
    return "; ".join(said)


def _batch_now(loader: Any, world: int) -> Optional[Batch]:
    """The loader's step batch; one micro-batch a rank for a loader that carries none."""
    batch = getattr(loader, "batch", None)
    if isinstance(batch, Batch):
        return batch
    per_rank = getattr(loader, "batch_size", None)
    return Batch(per_rank * world, world, 1, per_rank) if isinstance(per_rank, int) and \
        per_rank > 0 and world > 0 else None


def _unsynced_batchnorm(model: Any) -> int:
    if not isinstance(model, nn.Module):
        return 0
    return sum(1 for m in unwrap(model).modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm)
               and not isinstance(m, nn.SyncBatchNorm) and m.training)
