"""Is a directory shared by every node of the job? Checkpoints must be, or a restarted or requeued
job resumes on some ranks and not on others.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Union

from ..engines import comm
from ..base.errors import ConfigError, JobSetupError

__all__ = ["check_shared"]


def check_shared(directory: Union[str, Path], num_nodes: int, wait_s: float = 10.0) -> None:
    """On several nodes, raise :class:`~ddpkit.base.errors.JobSetupError` on every rank unless every
    rank sees what rank 0 writes in ``directory``; call it on EVERY rank (a no-op on one node).

    A node-local directory (``/tmp``, a node's scratch disk) holds rank 0's checkpoints on one
    node only: a restarted or requeued job would resume on some ranks and not on others. Rank 0
    writes a marker file; each rank looks for it for up to ``wait_s`` seconds (network file
    systems may show a new name late); rank 0 removes it.

    Example::

        check_shared(policy.directory, rt.env.num_nodes)   # before the first save or resume
    """
    if num_nodes <= 1 or comm.world_size() <= 1:
        return
    path, sent = Path(directory), None
    if comm.is_main():  # rank 0's directory is the one saved to and resumed from
        try:
            path.mkdir(parents=True, exist_ok=True)
            sent = str(path.resolve() / f".ddpkit-shared-{uuid.uuid4().hex}")
            Path(sent).write_text(socket.gethostname())
        except OSError as exc:
            sent = OSError(f"cannot write to checkpoint directory {path}: {exc}")
    sent = comm.broadcast_object(sent)
    if isinstance(sent, OSError):  # every rank stops, not only rank 0
        raise ConfigError(f"{sent}; choose a directory this job can write to")
    marker = Path(sent)
    path = marker.parent
    deadline = time.monotonic() + wait_s
    while not marker.exists() and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            os.listdir(path)  # revalidates a cached directory on NFS
        time.sleep(0.2)
    seen = comm.gather_object((marker.exists(), socket.gethostname()))
    if comm.is_main():
        with contextlib.suppress(OSError):
            marker.unlink()
    blind = sorted({host for ok, host in seen if not ok})
    if blind:
        raise JobSetupError(f"checkpoint directory {path} is not shared between the nodes: "
                            f"{', '.join(blind)} cannot see what rank 0 writes there on "
                            f"{seen[0][1]}, so a restarted or requeued job could not resume "
                            "from it; put it on a file system every node mounts (for `ddpkit "
                            "train`, --output)")
