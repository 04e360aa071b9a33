"""Does a checkpoint fit this run? Model and optimizer state checked with every mismatch named.

Used by resume before anything is loaded, so a wrong checkpoint is one clear line, not a
``load_state_dict`` traceback from every rank.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..base.errors import ConfigError

__all__ = ["check_compatible", "check_optimizer_compatible", "other_model",
           "named_model_differs"]

_SHOWN = 5                               # keys named per category in mismatch messages
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def check_compatible(model_state: Dict[str, Any], current: Any, what: str = "model") -> None:
    """Raise :class:`ConfigError` unless the checkpoint's state_dict fits ``current`` exactly.

    ``current`` is this run's ``module.state_dict()`` (or the module). The message names up
    to five missing keys, unexpected keys and shape mismatches.

    Example::

        check_compatible(state["model"], unwrap(model).state_dict())
    """
    if not isinstance(model_state, dict):
        raise ConfigError(f"checkpoint {what} state is a {type(model_state).__name__}, not a "
                          f"state_dict; save {what}.state_dict() in the checkpoint")
    missing, unexpected, shapes = _mismatches(model_state, current, what)
    if not (missing or unexpected or shapes):
        return
    parts = [f"{label}: {_some(items)}" for label, items in
             (("missing keys", missing), ("unexpected keys", unexpected),
              ("shape mismatches", shapes)) if items]
    hint = _prefix_hint(missing, unexpected)
    raise ConfigError(f"checkpoint {what} does not fit this run's {what} (the checkpoint is "
                      f"from a different {what}): {'; '.join(parts)}{hint}; build the same "
                      f"{what} as the run that saved it, or start fresh")


def other_model(model_state: Any, current: Any) -> Optional[str]:
    """Why ``model_state`` holds another model's weights than ``current`` (a module or its
    state_dict), in a few words for a line that names the file; None when it fits.

    Example::

        other_model({"w": torch.zeros(3)}, nn.Linear(2, 2))
        # "another model: 1 unexpected key (w), 2 missing keys (weight, ...)"
    """
    if not isinstance(model_state, dict):
        return f"its model state is a {type(model_state).__name__}, not a state_dict"
    missing, unexpected, shapes = _mismatches(model_state, current, "model")
    found = (("unexpected key", unexpected), ("missing key", missing), ("other shape", shapes))
    said = [f"{len(items)} {noun}{'s' if len(items) > 1 else ''} ({items[0].split(':')[0]}"
            f"{', ...' if len(items) > 1 else ''})" for noun, items in found if items]
    return f"another model: {', '.join(said)}" if said else None


def named_model_differs(ckpt: Any, config: Mapping[str, Any]) -> Optional[str]:
    """Why ``ckpt`` is another model's by the model its recorded ``config`` names, where it and
    this run's ``config`` both name one; None otherwise.

    Example::

        named_model_differs({"config": {"model": "small_cnn"}}, {"model": "resnet18"})
        # "written for model 'small_cnn', this run's is 'resnet18'"
    """
    saved = ckpt.get("config") if isinstance(ckpt, dict) else None
    if isinstance(saved, dict) and "model" in saved and "model" in config and \
            saved["model"] != config["model"]:
        return f"written for model {saved['model']!r}, this run's is {config['model']!r}"
    return None


def _mismatches(saved: Dict[str, Any], current: Any,
                what: str) -> Tuple[List[str], List[str], List[str]]:
    """The keys ``current`` has and ``saved`` lacks, those only ``saved`` has, and shape
    mismatches."""
    if hasattr(current, "state_dict"):
        current = current.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    return missing, unexpected, _shape_mismatches(saved, current, what)


def _shape_mismatches(saved: Dict[str, Any], current: Dict[str, Any], what: str) -> List[str]:
    out = []
    for key, value in current.items():
        ours, theirs = _shape(value), _shape(saved.get(key))
        if ours is not None and theirs is not None and ours != theirs:
            out.append(f"{key}: checkpoint {theirs} vs {what} {ours}")
    return out


def _shape(value: Any) -> Optional[Tuple[int, ...]]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _some(items: List[str]) -> str:
    more = f" (+{len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _prefix_hint(missing: List[str], unexpected: List[str]) -> str:
    # The commonest cause: one side was saved/loaded through a wrapper ("module." keys of DDP,
    # "_orig_mod." keys of torch.compile).
    if not (missing and unexpected and _unprefixed(missing) == _unprefixed(unexpected)):
        return ""
    if any("_orig_mod." in k for k in missing + unexpected):
        return (" (only the torch.compile '_orig_mod.' prefix differs: use ddpkit.unwrap(model) "
                "on both sides)")
    return " (only the DDP 'module.' prefix differs: use ddpkit.unwrap(model) on both sides)"


def _strip(key: str) -> str:
    while key.startswith(_WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def _unprefixed(keys: List[str]) -> List[str]:
    return sorted(_strip(k) for k in keys)


def plain_state(model_state: Dict[str, Any]) -> Dict[str, Any]:
    """``model_state`` without the ``_orig_mod.`` prefix that a ``torch.compile``'d model gives
    every key (ddpkit saved those before :func:`ddpkit.unwrap` unwrapped compiled models).

    Example::

        plain_state({"_orig_mod.fc.weight": w})   # {'fc.weight': w}
    """
    if not model_state or not all(str(k).startswith("_orig_mod.") for k in model_state):
        return model_state
    return {k[len("_orig_mod."):]: v for k, v in model_state.items()}


def check_optimizer_compatible(opt_state: Dict[str, Any],
                               optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`ConfigError` unless param groups and params per group match ``optimizer``.

    Example::

        check_optimizer_compatible(state["optimizer"], optimizer)
        optimizer.load_state_dict(state["optimizer"])
    """
    groups = opt_state.get("param_groups") if isinstance(opt_state, dict) else None
    if not isinstance(groups, list):
        raise ConfigError("checkpoint optimizer state has no 'param_groups'; save "
                          "optimizer.state_dict() there")
    saved = [len(g.get("params", [])) for g in groups]
    ours = [len(g["params"]) for g in optimizer.param_groups]
    if saved != ours:
        raise ConfigError(f"checkpoint optimizer has {_groups(saved)}; this run's optimizer has "
                          f"{_groups(ours)}; build the optimizer the same way as the saved run")


def _groups(counts: List[int]) -> str:
    noun = "param group" if len(counts) == 1 else "param groups"
    return f"{len(counts)} {noun} with {', '.join(map(str, counts)) or 'no'} params"
