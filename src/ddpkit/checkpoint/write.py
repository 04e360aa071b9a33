"""Writing checkpoints to disk: atomic files, and one line when the disk is full.

A full disk surfaces deep inside ``torch.save`` as an ``OSError`` followed by a ``RuntimeError``
from its zip writer (``enforce fail at inline_container.cc``), and inside DCP (sharded saves) as
a ``CheckpointException`` listing each rank's failure: :func:`disk_full` finds the ``OSError`` in
any of them, and :func:`no_space` says what could not be written, what is safe, how to go on.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import IO, Any, Callable, Dict, Optional, Sequence

import torch

from ..base.errors import JobSetupError

__all__ = ["SaveError", "atomic_write", "fsync_dir", "disk_full", "state_bytes", "no_space",
           "resume_advice", "RESUME_COMMAND_VAR"]

#: Set by ``ddpkit train`` for its workers: the command that continues the run, for error lines
#: (the library cannot know how a user's own script is started).
RESUME_COMMAND_VAR = "DDPKIT_RESUME_COMMAND"

# The errors that mean "no room for this file" (ENOSPC; a quota; a file-size limit, ulimit -f).
_NO_ROOM = {errno.ENOSPC: "no space left on the device",
            errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file size limit exceeded"}


class SaveError(JobSetupError):
    """A checkpoint could not be written. Rank 0 finds it and tells every rank; every rank raises
    it, and only rank 0 prints it (the others leave quietly, status 2: it is rank 0's finding).

    Example::

        raise SaveError("no space left on the device ...; free space, then resume with ...")
    """


def atomic_write(final: Path, write: Callable[[IO[bytes]], Any],
                 verify: Optional[Callable[[Path], None]] = None) -> None:
    """Write ``final`` through a temporary file, fsync and rename: readers see the old file or
    the complete new one, never a partial write; on any error the temporary file is removed.

    Example::

        atomic_write(Path("ckpt/latest"), lambda f: f.write(b"ckpt-000000120.pt\\n"))
    """
    tmp = final.with_name(final.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if verify is not None:
            verify(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a partial file would hold the very space the disk lacks
        raise
    fsync_dir(final.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (no-op on Windows, which cannot fsync a directory).

    Example::

        fsync_dir(Path("ckpt"))
    """
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_full(exc: BaseException) -> Optional[OSError]:
    """The "no room" ``OSError`` (no space, quota, file-size limit) behind ``exc``, or None.

    Looks through the causes and contexts (torch's zip writer raises its own error on top) and
    a DCP ``CheckpointException``'s per-rank failures.

    Example::

        disk_full(RuntimeError("enforce fail"))   # None; with an ENOSPC in its __context__: that
    """
    seen, todo = set(), [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in _NO_ROOM:
            return item
        todo += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)  # DCP: {rank: exception or (exception, stack)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` (each storage counted once): about a checkpoint's size.

    Example::

        state_bytes({"w": torch.zeros(1000)})   # 4000
    """
    storages: Dict[Any, int] = {}
    todo = [state]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo += list(item.values())
        elif isinstance(item, (list, tuple)):
            todo += list(item)
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item  # DTensor: this shard
            with contextlib.suppress(Exception):  # meta or exotic tensors: not counted
                storage = local.untyped_storage()
                storages[(local.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _size(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # unreachable


def _free(directory: Path) -> Optional[int]:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free
    return None


def _mount(directory: Path) -> Path:
    """The mount point of the filesystem that holds ``directory``: where space must be freed."""
    path = directory.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def no_space(err: OSError, what: str, directory: Path, needed: int,
             newest: Optional[Path], keep: int = 1, older: Sequence[int] = ()) -> str:
    """The one line for a checkpoint that did not fit: what, how much, on which filesystem, what
    is intact, what next. ``older``: the sizes of the checkpoints on disk older than the one
    that failed, oldest first (what a smaller ``keep`` could delete before the write).

    Example::

        no_space(OSError(28, "No space left on device"), "checkpoint ckpt/ckpt-000000012.pt",
                 Path("ckpt"), 287_000, Path("ckpt/ckpt-000000009.pt"), keep=3)
    """
    kept = (f"the newest intact checkpoint is {newest}" if newest is not None
            else "there is no earlier checkpoint")
    free, mount = _free(directory), _mount(Path(directory))
    where = f" (filesystem {mount}: {_size(free)} free)" if free is not None else ""
    return (f"{_NO_ROOM.get(err.errno or 0, err.strerror or str(err))}: {what} needs about "
            f"{_size(needed)}{where}; the partial write was removed and {kept}; "
            f"{_make_room(needed, free, mount, keep, older)}, then {resume_advice()}")


def _make_room(needed: int, free: Optional[int], mount: Path, keep: int,
               older: Sequence[int]) -> str:
    # keep=K holds max(K, 2) - 1 older checkpoints while the next is written (the newest complete
    # one always stays): a smaller keep is advice only where the ones it deletes make room.
    if free is not None:
        for fewer in range(keep - 1, 1, -1):  # the most checkpoints that still make room
            doomed = older[:max(0, len(older) - (fewer - 1))]
            if doomed and free + sum(doomed) >= needed:
                return (f"free space (or keep fewer checkpoints: keep={fewer} / --ckpt-keep "
                        f"{fewer} holds {fewer} on disk while the next is written, "
                        f"{len(older) + 1} now)")
    if free is None or free >= needed:  # a quota or a file-size limit, not the disk itself
        return "free space"
    deletable = sum(older[:-1])
    why = ("only the newest intact checkpoint is left, and it stays" if deletable == 0 else
           f"deleting all but the newest would free only {_size(deletable)}")
    return (f"free at least {_size(needed - free)} more on {mount} (keeping fewer checkpoints "
            f"would not make room: {why})")


def resume_advice() -> str:
    """How this run continues: ``ddpkit train``'s command, or rerunning a user's own script.

    Example::

        resume_advice()   # 'rerun the script: resume="auto" (the default) continues from it'
    """
    command = os.environ.get(RESUME_COMMAND_VAR)
    if command:
        return f"resume with `{command}`"
    return 'rerun the script: resume="auto" (the default) continues from the newest checkpoint'
