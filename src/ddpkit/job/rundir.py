"""One ``ddpkit train`` per run directory: a lock file in it (``ddpkit.lock``: host, pid, start
time) held by the launching process until the job ends, restarts included.

A second run with the same ``--output`` stops with one line naming the run that holds it. The
lock is an ``flock`` on the file, so the kernel releases it when its holder dies however it
dies; a lock file left by a dead run on this host is taken over with one line. One left by
another host cannot be checked from here: the line says to delete it if that run is gone.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from typing import Any, Dict, Iterator, Optional

from ..base.errors import ConfigError

__all__ = ["hold_run_dir", "LOCK_NAME"]

#: The lock file's name inside the run directory.
LOCK_NAME = "ddpkit.lock"

try:  # POSIX; elsewhere the lock is the file's contents alone
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def hold_run_dir(directory: str, lock: bool = True) -> Iterator[None]:
    """Create the run ``directory`` and, with ``lock``, hold its lock for the block.

    Raises :class:`ConfigError` when ``directory`` is a file or cannot be created, or when
    another live run holds it.

    Example::

        with hold_run_dir("runs/demo"):
            ...   # write config.json, run the job
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"--output {directory} is a file; give a directory for the run "
                          "(config, metrics, checkpoints)")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:  # read-only file system, no permission, disk full
        raise ConfigError(f"cannot write the run directory {directory} "
                          f"({exc.strerror or exc}); choose a writable --output") from None
    if not lock:
        yield
        return
    fd = _acquire(os.path.join(directory, LOCK_NAME), directory)
    try:
        yield
    finally:
        _release(fd, os.path.join(directory, LOCK_NAME))


def _acquire(path: str, directory: str) -> int:
    # Retry when the file was replaced between open and flock (its holder removed it on exit
    # and another run made a new one): a lock on a removed file guards nothing.
    for _ in range(10):
        fd = _open(path, directory)
        try:
            locked = _flock(fd, directory)
            if os.fstat(fd).st_ino != _inode(path):
                os.close(fd)
                continue
            _claim(fd, path, directory, locked)
            return fd
        except BaseException:
            os.close(fd)
            raise
    raise ConfigError(f"could not lock the run directory {directory}: {path} keeps changing; "
                      "is another run starting there?")


def _open(path: str, directory: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot write the run directory {directory} "
                          f"({exc.strerror or exc}); choose a writable --output") from None


def _inode(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _flock(fd: int, directory: str) -> Optional[bool]:
    """True: locked; raises when a live process holds it; None: no flock on this file system."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        raise ConfigError(f"--output {directory} is in use by another `ddpkit train` "
                          f"({_who(_read(fd))}): wait for it to end, or give this run another "
                          "--output") from None
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None  # e.g. a network file system mounted without locks: the contents decide
        raise


def _claim(fd: int, path: str, directory: str, locked: Optional[bool]) -> None:
    holder = _read(fd)
    if holder is not None and holder.get("pid") != os.getpid():
        _take_over(holder, path, directory, locked)
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    os.fsync(fd)


def _take_over(holder: Dict[str, Any], path: str, directory: str,
               locked: Optional[bool]) -> None:
    # The file could be flocked, so its holder is gone: the kernel drops a dead process's flock.
    # Not so on another host (a network file system may not share flocks between hosts), nor,
    # without flock, while the named pid still runs here.
    alive = _alive(holder.get("pid"))
    if holder.get("host") != socket.gethostname():
        raise ConfigError(f"--output {directory} is locked by a `ddpkit train` on another host "
                          f"({_who(holder)}), which this host cannot check: if that run has "
                          f"ended, delete {path} and start again; otherwise give this run "
                          "another --output")
    if locked is None and alive:
        raise ConfigError(f"--output {directory} is in use by another `ddpkit train` "
                          f"({_who(holder)}): wait for it to end, or give this run another "
                          "--output")
    gone = "which no longer holds it" if alive else "which is no longer running"
    print(f"warning: taking over the lock of {directory} from pid {holder.get('pid')} on this "
          f"host (since {holder.get('since', '?')}), {gone}", file=sys.stderr, flush=True)


def _who(holder: Optional[Dict[str, Any]]) -> str:
    if not holder:
        return "a run that is just starting"
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
            f"{holder.get('since', '?')}")


def _read(fd: int) -> Optional[Dict[str, Any]]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _release(fd: int, path: str) -> None:
    # Remove the file while still holding the lock (a waiting run then sees a new file), then
    # let go of the lock with the descriptor.
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_ino == _inode(path):
            os.unlink(path)
    os.close(fd)
