"""Ray Train's side of the checkpoints: each one on disk is handed to ``ray.train.report``, and a
worker group that Ray restarts (``FailureConfig(max_failures=)``) resumes from the newest Ray kept.

Used by :class:`~ddpkit.checkpoint.checkpointer.Checkpointer` when the process is a Ray Train
worker (``ClusterEnv.launcher == "ray"``); ``ray`` is imported only there.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from ..env.detect import ClusterEnv
from .names import checkpoint_name
from .sharded import shards_name

__all__ = ["RayReport", "running", "newest", "log_dir"]


def running(env: ClusterEnv) -> bool:
    """Whether this process is a worker of Ray Train (its TorchTrainer made the group).

    Example::

        if running(rt.env): print("under Ray Train")
    """
    return env.launcher == "ray"


@contextlib.contextmanager
def newest() -> Iterator[Optional[Path]]:
    """Every rank: the newest checkpoint Ray kept for this run, as a local directory (Ray
    downloads it when its storage is remote), or None: a first attempt, or nothing reported yet.

    Example::

        with newest() as kept:
            if kept is not None: ckpt.restore(kept)
    """
    import ray.train

    kept = ray.train.get_checkpoint()
    if kept is None:
        yield None
        return
    with kept.as_directory() as local:
        yield Path(local)


def log_dir() -> Optional[str]:
    """Where ``rt.log`` writes by default under Ray Train: ``<storage_path>/<run name>/log``
    when Ray's storage is this machine's file system (a worker's working directory is inside
    Ray's session directory, gone with the cluster), else None (``runs/...`` there after all).

    Example::

        log_dir()   # '/shared/ray/run1/log'
    """
    try:
        import pyarrow.fs
        import ray.train

        storage = ray.train.get_context().get_storage()  # Ray's developer API
        if isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
            return str(Path(storage.experiment_fs_path) / "log")
    except Exception:  # noqa: BLE001 - another Ray version's storage: the usual default
        pass
    return None


class RayReport:
    """Hands each checkpoint to Ray once it is whole on disk: every rank calls
    :meth:`saved` at the same step (Ray's report is collective); rank 0 gives the files.

    Example::

        report = RayReport(Path("ckpt"), is_main=rt.is_main)
        report.saved(step=200, epoch=1)      # after checkpoint 200 is on disk, every rank
    """

    def __init__(self, directory: Path, is_main: bool) -> None:
        self.directory, self.is_main = directory, is_main
        self.reported: Optional[int] = None  # the step handed over last

    def saved(self, step: int, epoch: int) -> None:
        """Checkpoint ``step`` is on disk: report it to Ray (once; every rank)."""
        if step == self.reported:
            return
        import ray.train

        self.reported = step
        metrics: Dict[str, Any] = {"step": step, "epoch": epoch}
        if not self.is_main:
            ray.train.report(metrics, checkpoint=None)
            return
        with self._staged(step) as staged:  # Ray copies a directory; ours holds every step
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(staged),
                             checkpoint_dir_name=f"ddpkit-{step:09d}")

    @contextlib.contextmanager
    def _staged(self, step: int) -> Iterator[str]:
        # A directory with this step's file (and its shards): links, no copy, beside the files.
        staged = self.directory / f".ray-{step:09d}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        try:
            for name in (checkpoint_name(step), shards_name(step)):
                _link(self.directory / name, staged / name)
            yield str(staged)
        finally:
            shutil.rmtree(staged, ignore_errors=True)


def _link(source: Path, target: Path) -> None:
    if source.is_dir():
        target.mkdir()
        for child in source.iterdir():
            _link(child, target / child.name)
    elif source.exists():
        try:
            os.link(source, target)
        except OSError:  # a file system without hard links
            shutil.copy2(source, target)
