"""The user's own state in a checkpoint (``extra=`` and
:meth:`~ddpkit.checkpoint.checkpointer.Checkpointer.register`): PyTorch ``Stateful`` objects
(``state_dict`` / ``load_state_dict``: restored in place) or plain values (tensors, numbers,
strings, lists, dicts: the script's own lists and dicts refilled in place, others replaced).

``Stateful`` is :class:`torch.distributed.checkpoint.stateful.Stateful`, a runtime-checkable
protocol; :func:`stateful` applies its test (both methods there, and callable) without
importing ``torch.distributed.checkpoint``, which costs every process that saves ~2 s.

Example::

    check_register("ema", ema, registered={"best": 0.0})   # or a one-line ConfigError
    restore_value(extra, "ema", saved_state)               # ema.load_state_dict(saved_state)
"""
from __future__ import annotations

from typing import Any, Collection, MutableMapping

from ..base.errors import ConfigError
from .arguments import RESERVED
from .pickles import _first_unplain

__all__ = ["stateful", "restore_value", "check_register"]


def stateful(value: Any) -> bool:
    """Whether ``value`` saves and restores itself: PyTorch's ``Stateful`` protocol
    (``state_dict`` / ``load_state_dict``), both callable.

    Example::

        stateful(torch.optim.lr_scheduler.StepLR(opt, 1))   # True
    """
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def restore_value(extra: MutableMapping[str, Any], name: str, value: Any) -> None:
    """Put the checkpoint's ``value`` for ``name`` into ``extra``: a Stateful object there
    loads it in place, a list or dict of the same type is refilled in place (the script may
    hold that very object), anything else is replaced.

    Example::

        restore_value(ckpt.extra, "history", [{"epoch": 0}])   # the same list, refilled
    """
    current = extra.get(name)
    if stateful(current):
        current.load_state_dict(value)
    elif type(current) is type(value) and isinstance(value, (list, dict)):
        current.clear()  # in place: the script may hold this very list or dict
        (current.extend if isinstance(value, list) else current.update)(value)
    else:
        extra[name] = value


def check_register(name: Any, obj: Any, registered: Collection[str]) -> None:
    """A name free for the user's state and an object a checkpoint can hold, or a one-line
    :class:`ConfigError`: a name the checkpoint uses itself or one registered already; an
    object neither Stateful nor plain (what the safe loader reads back).

    Example::

        check_register("model", net, registered=())   # ConfigError: taken by the checkpoint
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"register(name, obj): name must be a non-empty string, got {name!r}")
    if name in RESERVED:
        raise ConfigError(f"register({name!r}, ...): the name is taken by the checkpoint itself; "
                          f"choose another (reserved: {', '.join(sorted(RESERVED))})")
    if name in registered:
        raise ConfigError(f"register({name!r}, ...): {name!r} is registered already (in extra= "
                          f"or an earlier register); assign ckpt.extra[{name!r}] to change a "
                          "plain value")
    if not stateful(obj) and _first_unplain(obj, name) is not None:
        raise ConfigError(f"register({name!r}, ...): a {type(obj).__name__} is neither Stateful "
                          f"(state_dict / load_state_dict) nor a plain value (at "
                          f"{_first_unplain(obj, name)}; tensors, numbers, strings, lists, dicts); "
                          "give it state_dict and load_state_dict, or register its state")
