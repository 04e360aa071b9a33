"""Exact resume: what a run's checkpoint holds (:func:`run_state`) and how a run picks up from
one (:func:`restore`), mid-epoch included; the loop (:mod:`ddpkit.loop`) calls both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import comm
from .checkpoint import (check_compatible, check_optimizer_compatible, checkpoint_metadata,
                         load_checkpoint, resolve_resume)
from .ckpt_compat import plain_state
from .seed import rng_state, set_rng_state
from .sharded import is_sharded, load_full_state, load_shards
from .wrap import unwrap

__all__ = ["TrainState", "run_state", "restore"]


@dataclass
class TrainState:
    """Progress of a run: completed epochs, optimizer steps, best metric, per-epoch history.

    Example::

        state = fit(...); print(state.best, state.history[-1])
    """

    epoch: int = 0
    step: int = 0
    best: Optional[float] = None
    best_epoch: Optional[int] = None
    history: List[Dict[str, float]] = field(default_factory=list)



def run_state(self: Any, shards: Optional[str] = None) -> Dict[str, Any]:
    """Everything a bit-exact resume needs, gathered on every rank (``self`` is the running
    fit): weights, optimizer, schedule, scaler, loader position, progress, every rank's RNG.
    With ``shards`` (an FSDP run: :mod:`ddpkit.sharded` wrote the model and optimizer) the
    checkpoint names that directory instead of holding them.

    Example::

        save_checkpoint(run_state(loop), "ckpt", loop.state.step)
    """
    sched = self.cfg.scheduler
    weights = {"sharded": shards} if shards else {
        "model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}
    return {**weights,
            "scheduler": sched.state_dict() if sched is not None else None,
            "precision": self.precision.state_dict(), "loader": self.loader.state_dict(),
            "progress": {"epoch": self.state.epoch, "step": self.state.step,
                         "best": self.state.best, "best_epoch": self.state.best_epoch,
                         "mid_epoch": self.loader.batches_done > 0 and not self._epoch_done},
            "history": self.state.history, "rng": comm.gather_object(rng_state()),
            "world_size": self.rt.world_size, "config": self.cfg.config,
            "meta": checkpoint_metadata()}


def restore(self: Any) -> None:
    """Continue the running fit from ``self.ckpt.resume`` (a path or ``"auto"``), if any: rank 0
    picks the file, every rank loads it.

    Example::

        restore(loop)   # before the first epoch
    """
    if self.ckpt is None or not self.ckpt.resume:
        return
    # Rank 0 chooses, so every rank resumes from the same file even if one is being damaged.
    # Loaded to the CPU on every device: RNG states must be CPU tensors, and load_state_dict
    # copies weights and optimizer state onto the parameters' device (GPU <-> CPU resumes).
    found = (resolve_resume(self.ckpt.resume, self.ckpt.directory, "cpu")
             if self.rt.is_main else None)
    chosen = comm.broadcast_object(str(found[0]) if found else None)
    if chosen is None:
        comm.print0(f"no checkpoint in {self.ckpt.directory}: starting fresh")
        return
    path = chosen
    ckpt = found[1] if found else load_checkpoint(chosen, map_location="cpu")
    net = unwrap(self.model)
    if ckpt.get("sharded"):  # FSDP's shards, on any number of ranks (DCP reshards)
        load_shards(self.model, self.optimizer, Path(path).parent / ckpt["sharded"])
    else:
        saved = plain_state(ckpt["model"])
        check_compatible(saved, net.state_dict())
        check_optimizer_compatible(ckpt["optimizer"], self.optimizer)
        if is_sharded(net):  # a DDP / one-process checkpoint into an FSDP run
            load_full_state(net, self.optimizer, saved, ckpt["optimizer"])
        else:
            net.load_state_dict(saved)
            self.optimizer.load_state_dict(ckpt["optimizer"])
    if self.cfg.scheduler is not None and ckpt.get("scheduler"):
        self.cfg.scheduler.load_state_dict(ckpt["scheduler"])
    self.precision.load_state_dict(ckpt["precision"])
    _restore_progress(self, ckpt)
    comm.print0(f"resumed from {path} (epoch {self.state.epoch}, step {self.state.step}"
                f"{', mid-epoch' if self.resumed_mid_epoch else ''})")

def _restore_progress(self: Any, ckpt: Dict[str, Any]) -> None:
    p = ckpt["progress"]
    self.state = TrainState(p["epoch"], p["step"], p["best"], p["best_epoch"],
                            list(ckpt.get("history", [])))
    self.resumed_mid_epoch = bool(p["mid_epoch"])
    self.start_position = (self.state.epoch, 0)
    if self.resumed_mid_epoch:
        self.loader.load_state_dict(ckpt["loader"])
        self.start_position = (self.state.epoch, int(ckpt["loader"]["samples_done"]))
    same_world = ckpt.get("world_size") == self.rt.world_size
    if same_world:  # per-rank RNG streams only make sense for the same ranks
        set_rng_state(ckpt["rng"][self.rt.rank])
    else:
        comm.print0(f"warning: checkpoint from {ckpt.get('world_size')} processes resumed "
                    f"on {self.rt.world_size}: the interrupted epoch continues without loss "
                    "or repetition of samples, but RNG streams and batch composition differ")
