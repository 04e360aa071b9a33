"""What a file the safe loader refused asks for: a pickle naming code to call (a malicious or
foreign checkpoint) told apart from a torn or random file, without running it.

torch's ``weights_only`` unpickler stops at the first opcode it does not know; for a pickle of
protocol 4 or 5 that is the framing, before any global is read, so its own message cannot say
which case it was. :func:`code_named` reads the opcodes with :mod:`pickletools`, which only parses.
:func:`refuse_unloadable` finds at save time what that loader would refuse at resume time.
"""
from __future__ import annotations

import contextlib
import pickletools
import re
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any, Dict, Iterator, List, Optional

import torch

from ..base.errors import ConfigError

__all__ = ["code_named", "refused_line", "refuse_unloadable"]

# Opcodes that import a name (GLOBAL, INST: "module name" in their argument; STACK_GLOBAL: the
# two strings pushed before it).
_NAMING = ("GLOBAL", "INST")
_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
            "BINSTRING", "STRING")
# What torch.save itself names; anything else is what made the safe loader refuse.
_TORCH_OWN = ("torch.", "collections.OrderedDict", "builtins.set")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
# Exact types: subclasses (e.g. torch.__version__, a str subclass) pickle as refused globals.
_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.Size, torch.dtype, torch.device)


def code_named(path: Path) -> Optional[str]:
    """The first importable name (``module.attr``) the pickle in ``path`` asks for beyond what a
    torch.save of tensors names, or None when it names none (random bytes, a torn tensor file).
    A torn file counts up to where it ends. Nothing is imported or called.

    Example::

        code_named(Path("evil.pt"))   # 'posix.system'
    """
    try:
        with _pickle_stream(path) as stream:
            names = _names(stream)
    except (OSError, zipfile.BadZipFile, KeyError, ValueError):
        return None
    # a dotted Python name: bytes of a torn or random file that parse as an opcode by chance
    # do not read as a request for code
    foreign = [n for n in names if _DOTTED.fullmatch(n) and not n.startswith(_TORCH_OWN)]
    return foreign[0] if foreign else None


def refused_line(path: Path, name: str) -> str:
    """The one line for a checkpoint that asks for ``name``: refused, never run.

    Example::

        refused_line(Path("evil.pt"), "posix.system")
    """
    return (f"checkpoint {path} refused: not a ddpkit checkpoint, not loaded (it asks for "
            f"{name}, code that the safe weights_only loader never runs); load only checkpoints "
            "written by save_checkpoint, from a source you trust")


@contextlib.contextmanager
def _pickle_stream(path: Path) -> Iterator[IO[bytes]]:
    """The pickle's bytes: the ``data.pkl`` record of a torch.save archive, or the file."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            yield f
        return
    with zipfile.ZipFile(path) as archive:
        members = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if not members:
            raise KeyError("data.pkl")
        with archive.open(members[0]) as f:
            yield f


def _names(stream: IO[bytes]) -> List[str]:
    names: List[str] = []
    strings: List[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(stream):
            if opcode.name in _STRINGS and isinstance(arg, (str, bytes)):
                strings = (strings + [arg if isinstance(arg, str) else arg.decode("latin-1")])[-2:]
            elif opcode.name in _NAMING and isinstance(arg, str):
                names.append(arg.replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) == 2:
                names.append(".".join(strings))
    except Exception:  # torn or not a pickle: what was read so far is the answer
        pass
    return names


def refuse_unloadable(tmp: Path, state: Dict[str, Any]) -> None:
    """Fail at save time on what load_checkpoint (weights_only) would refuse at resume time: the
    unsafe globals torch finds in the written ``tmp``, and the first value of ``state`` that
    holds one.

    Example::

        refuse_unloadable(Path("ckpt/ckpt-000000012.pt.tmp"), state)
    """
    finder = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    unsafe = sorted(finder(str(tmp))) if finder is not None else []
    if unsafe:
        where = _first_unplain(state, "state")
        at = f" at {where}" if where else ""
        raise ConfigError(f"checkpoint state holds objects that load_checkpoint would refuse "
                          f"({', '.join(unsafe[:3])}){at}; store only tensors, numbers, strings, "
                          "lists and dicts (e.g. numpy arrays as torch tensors)")


def _first_unplain(value: Any, where: str) -> Optional[str]:
    # Best effort: name the first value that is neither a container nor a plain leaf.
    if type(value) in (dict, OrderedDict):
        items = [(f"{where}[{k!r}]", v) for k, v in value.items()]
    elif type(value) in (list, tuple):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        plain = isinstance(value, torch.Tensor) or type(value) in _PLAIN
        return None if plain else f"{where} ({type(value).__name__})"
    for sub, item in items:
        found = _first_unplain(item, sub)
        if found:
            return found
    return None
