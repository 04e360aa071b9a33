"""What a checkpoint file is called (``ckpt-{step:09d}.pt``, so names sort by step) and which
of them a directory holds: shared by the whole-state files and the sharded ones."""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Union

from ..base.errors import ConfigError

__all__ = ["checkpoint_name", "list_checkpoints"]

_NAME = re.compile(r"ckpt-(\d+)\.pt")


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint for ``step`` (zero-padded so names sort by step).

    Example::

        checkpoint_name(42)   # 'ckpt-000000042.pt'
    """
    return f"ckpt-{step:09d}.pt"


def list_checkpoints(directory: Union[str, Path]) -> List[Path]:
    """The ``ckpt-*.pt`` files in ``directory``, oldest step first (``.tmp`` files are ignored).

    Example::

        list_checkpoints("ckpt")   # [.../ckpt-000000500.pt, .../ckpt-000001000.pt]
    """
    directory = Path(directory).expanduser()
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise ConfigError(f"checkpoint directory {directory} is a file; pass a directory")
    found = [(int(m.group(1)), p.name, p) for p in directory.iterdir()
             if (m := _NAME.fullmatch(p.name)) and p.is_file()]
    return [p for _, _, p in sorted(found)]


def _step_of(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else -1
