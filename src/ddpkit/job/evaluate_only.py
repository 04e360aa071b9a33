"""``ddpkit train --eval-only``: the model of a checkpoint, evaluated on the test set on any
number of processes (exact: every test sample once, whatever the shards), and nothing trained or
written. The training batch need not split over these processes: no training loader is made.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

from ..engines import comm
from ..checkpoint.files import load_checkpoint, resolve_resume
from ..checkpoint.restore import load_weights, not_this_run
from ..base.errors import ConfigError
from ..training.evaluation import perplexity
from ..training.log import format_scores
from ..training.precision import Precision
from .config import TrainConfig
from .datasets import dataset_key

__all__ = ["evaluate_checkpoint", "eval_line"]


def evaluate_checkpoint(cfg: TrainConfig, rt: Any, model: Any, test_set: Any) -> Dict[str, Any]:
    """Load ``cfg.resume``'s weights into ``model`` (every rank: rank 0 chooses the file) and
    evaluate it on ``test_set``; the metrics as the epoch lines name them, with the checkpoint's
    path and step. Rank 0 prints one line.

    Example::

        metrics = evaluate_checkpoint(cfg, rt, model, test_set)   # cfg.eval_only, cfg.resume
    """
    directory = os.path.join(cfg.output, "checkpoints")
    found = (resolve_resume(cfg.resume, directory, "cpu",  # another model's: skipped
                            fits=lambda state: not_this_run(state, model, {"model": cfg.model}))
             if rt.is_main else None)
    chosen = comm.broadcast_object(str(found[0]) if found else None)
    if chosen is None:
        raise ConfigError(f"--eval-only: no checkpoint in {directory} to evaluate; give --resume "
                          "a checkpoint file or a run's checkpoints directory")
    ckpt = found[1] if found else load_checkpoint(chosen, map_location="cpu")
    load_weights(model, None, ckpt, Path(chosen))
    result = rt.evaluate(model, test_set, per_rank_batch=cfg.eval_batch_size,
                         precision=Precision(cfg.precision, rt.device),
                         channels_last=cfg.channels_last)
    if dataset_key(cfg.data) == "text" and "loss" in result:
        result["perplexity"] = perplexity(result["loss"])
    metrics: Dict[str, Any] = {f"eval/{k}": v for k, v in result.items()}
    metrics.update(checkpoint=chosen, step=int(ckpt.get("progress", {}).get("step", 0)))
    comm.print0(eval_line(metrics, rt.world_size))
    return metrics


def eval_line(m: Dict[str, Any], processes: int) -> str:
    """The one line of an evaluate-only run.

    Example::

        eval_line({"eval/loss": 0.74, "eval/top1": 89.4, "eval/count": 359,
                   "checkpoint": "runs/demo/checkpoints/ckpt-000000023.pt", "step": 23}, 3)
        # 'eval of runs/demo/checkpoints/ckpt-000000023.pt (step 23) on 3 processes: loss ...'
    """
    where = f"{processes} process{'es' if processes != 1 else ''}"
    loss = f"loss {m['eval/loss']:.4f}" if "eval/loss" in m else "no loss"
    return "  ".join([f"eval of {m['checkpoint']} (step {m['step']}) on {where}: {loss}",
                      *format_scores(m), f"({m.get('eval/count', 0)} targets)"])
