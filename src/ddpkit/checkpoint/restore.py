"""Putting a loaded checkpoint back into the live run: weights and optimizer (checked for fit
first; FSDP shards or a full state into an FSDP model), the schedule, scaler and precision, the
user's extras (restored in place where the script holds them), the loader's next position.

Example::

    ckpt = load_checkpoint("ckpt/ckpt-000000120.pt")
    load_weights(model, optimizer, ckpt, Path("ckpt/ckpt-000000120.pt"))
    load_parts({"scheduler": sched}, extra, ckpt)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, MutableMapping, Optional

from torch import nn

from ..engines import comm
from .compat import (check_compatible, check_optimizer_compatible, named_model_differs,
                     other_model, plain_state)
from .per_rank import own_extras
from .registry import restore_value, stateful
from .sharded import is_sharded, load_full_state, load_shards
from ..base.wrap import unwrap

__all__ = ["load_weights", "load_parts", "next_position", "stateful", "not_this_run"]


def load_weights(model: nn.Module, optimizer: Any, ckpt: Dict[str, Any], path: Path) -> None:
    """Load the checkpoint's model and optimizer state (from ``path``'s shards when sharded),
    after checking that they fit this model and optimizer.

    Example::

        load_weights(model, opt, load_checkpoint(path), Path(path))
    """
    net = unwrap(model)
    if ckpt.get("sharded"):  # FSDP's shards, on any number of ranks (DCP reshards)
        load_shards(model, optimizer, path.parent / ckpt["sharded"])
        return
    saved = plain_state(ckpt["model"])
    check_compatible(saved, net.state_dict())
    if optimizer is not None and ckpt.get("optimizer") is not None:
        check_optimizer_compatible(ckpt["optimizer"], optimizer)
    if is_sharded(net):  # a DDP / one-process checkpoint into an FSDP run
        load_full_state(net, optimizer, saved, ckpt.get("optimizer"))
        return
    net.load_state_dict(saved)
    if optimizer is not None and ckpt.get("optimizer") is not None:
        optimizer.load_state_dict(ckpt["optimizer"])


def not_this_run(ckpt: Dict[str, Any], model: nn.Module,
                 config: Mapping[str, Any]) -> Optional[str]:
    """Why a checkpoint that ``resume="auto"`` found among the run's is another model's: the
    model its config names (where both configs name one), or its weights' names and shapes;
    None when it is this run's (a sharded one is checked as its shards load).

    Example::

        not_this_run(load_checkpoint(path), model, {"model": "resnet18"})
        # "written for model 'small_cnn', this run's is 'resnet18'"
    """
    named = named_model_differs(ckpt, config)
    if named is not None:
        return named
    if ckpt.get("sharded") or not isinstance(ckpt.get("model"), dict):
        return None  # not a state_dict: load_weights says so
    return other_model(plain_state(ckpt["model"]), unwrap(model).state_dict())


def load_parts(parts: Mapping[str, Any], extra: MutableMapping[str, Any],
               ckpt: Dict[str, Any]) -> List[str]:
    """Restore the named parts (scheduler, scaler, precision) and the extras: objects with
    ``load_state_dict`` and the script's own lists and dicts in place, other values replaced;
    an extra saved per rank from this rank's entry. Returns the extras saved per rank that
    another number of ranks cannot map (they keep their values, on every rank).

    Example::

        load_parts({"scheduler": sched, "scaler": None}, ckpt_obj.extra, ckpt)   # []
    """
    for name, part in parts.items():
        if part is not None and ckpt.get(name) is not None:
            part.load_state_dict(ckpt[name])
    mine, left = own_extras(ckpt, _saved_extras(ckpt), comm.rank(), comm.world_size())
    for name, value in mine.items():
        restore_value(extra, name, value)
    return left


def next_position(loader: Dict[str, Any], progress: Dict[str, Any]) -> Dict[str, Any]:
    """The loader state to continue from.

    Checkpoints written before the loader knew a finished pass from one in progress said
    "epoch e, mid_epoch False" with the loader still at e: the run goes on with epoch e + 1.

    Example::

        next_position({"epoch": 1, "samples_done": 0}, {"epoch": 2, "mid_epoch": False})
    """
    if "mid_epoch" in progress and not progress["mid_epoch"] and \
            int(loader["epoch"]) < int(progress["epoch"]):
        return {**loader, "epoch": int(progress["epoch"]), "samples_done": 0}
    return loader


def _saved_extras(ckpt: Dict[str, Any]) -> Dict[str, Any]:
    if "extra_names" in ckpt:
        return {name: ckpt[name] for name in ckpt["extra_names"]}
    # Written by fit before the Checkpointer: its history, and the best metric in "progress".
    progress = ckpt.get("progress", {})
    legacy = {"history": ckpt["history"]} if "history" in ckpt else {}
    if "best" in progress:
        legacy["best"] = {"best": progress["best"], "best_epoch": progress.get("best_epoch")}
    return legacy
