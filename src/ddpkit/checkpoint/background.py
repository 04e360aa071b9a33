"""Asynchronous checkpoints: the training step waits only for a snapshot of the state into
reused host buffers; rank 0 serialises and writes it in a background thread.

A save is exact (the snapshot is the state at the step boundary: the next optimizer step
changes the parameters, not the copy) and crash-safe (the file is written through a temporary
name, fsynced and renamed, and only then named ``latest``; ``kill -9`` at any moment leaves the
previous checkpoint loadable). At most one save is in flight: the next one waits for it, and
its failure (a full disk, a read-only directory) reaches every rank at its next question.

Example::

    saver = BackgroundSaver()
    saver.finish()                                   # every rank: the previous save is done
    path = saver.start(state, Path("ckpt"), step=120, keep=3)   # rank 0: writes in the background
"""
from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..engines import comm
from ..base.errors import DDPKitError
from ..base.seed import rng_state
from .names import checkpoint_name
from .write import SaveError, state_bytes

__all__ = ["Snapshot", "BackgroundSaver", "gathered_rng"]

_PLAIN = (int, float, bool, str, bytes, type(None))


class Snapshot:
    """Copies a state (nested dicts, lists, tuples, tensors, plain values) into host buffers
    reused from one save to the next (pinned when the tensors are on a GPU).

    Storages are copied whole, once each, and views rebuilt on the copies: tensors that share
    memory (tied weights) still share it, as :func:`torch.save` would store them.

    Example::

        snap = Snapshot()
        copy = snap.take({"w": model.weight})   # model.weight may change now; copy["w"] will not
    """

    def __init__(self) -> None:
        self._buffers: List[torch.UntypedStorage] = []
        self.nbytes = 0  #: bytes of host memory the buffers hold

    def take(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this snapshot's host buffers."""
        copies: Dict[Tuple[Any, int], torch.UntypedStorage] = {}
        pending: List[Tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        result = self._copy(state, copies, pending)
        on_gpu = False
        for host, source in pending:
            on_gpu = on_gpu or source.device.type == "cuda"
            host.copy_(source, non_blocking=source.device.type == "cuda")
        if on_gpu:
            torch.cuda.synchronize()  # the pinned copies are complete before the step goes on
        self.nbytes = sum(b.nbytes() for b in self._buffers)
        return result

    def _copy(self, value: Any, copies: Dict[Tuple[Any, int], torch.UntypedStorage],
              pending: List[Tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, copies, pending)
        if isinstance(value, dict):
            out = copy.copy(value)  # keeps an OrderedDict an OrderedDict
            for key, item in value.items():
                out[key] = self._copy(item, copies, pending)
            return out
        if isinstance(value, list):
            return [self._copy(item, copies, pending) for item in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            if all(type(item) in _PLAIN for item in value):  # immutable (Python's RNG state)
                return value
            return tuple(self._copy(item, copies, pending) for item in value)
        return copy.deepcopy(value)

    def _tensor(self, t: torch.Tensor, copies: Dict[Tuple[Any, int], torch.UntypedStorage],
                pending: List[Tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> torch.Tensor:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return t.detach().clone().cpu()  # a tensor subclass: a plain copy
        t = t.detach()
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        host = copies.get(key)
        if host is None:
            host = self._buffer(len(copies), storage.nbytes(), storage.device.type == "cuda")
            copies[key] = host
            pending.append((host, storage))
        out = torch.empty(0, dtype=t.dtype)
        out.set_(host, t.storage_offset(), t.size(), t.stride())
        if t.requires_grad:
            out.requires_grad_(False)
        return out

    def _buffer(self, index: int, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        if index < len(self._buffers) and self._buffers[index].nbytes() == nbytes:
            return self._buffers[index]
        made = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        if index < len(self._buffers):
            self._buffers[index] = made
        else:
            self._buffers.append(made)
        return made


class BackgroundSaver:
    """At most one checkpoint write in flight, in a thread on rank 0; every rank learns how
    it ended at :meth:`finish` (waits) or :meth:`poll` (asks), both collectives.

    ``write(state, directory, step, keep)`` writes the file (rank 0 only) and returns its
    path; its :class:`~ddpkit.base.errors.DDPKitError` message becomes a :class:`SaveError` on
    every rank.

    Example::

        saver = BackgroundSaver(write=_save_on_main)
        saver.finish(); saver.start(state, Path("ckpt"), 120, keep=3)
    """

    def __init__(self, write: Callable[[Dict[str, Any], Path, int, int], Path],
                 say: Callable[[str], None] = comm.print0) -> None:
        self._write, self._say = write, say
        self.snapshot = Snapshot()
        self.in_flight: Optional[int] = None  #: the step being written (every rank knows it)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        self._said_memory = False

    def start(self, state: Dict[str, Any], directory: Path, step: int, keep: int,
              first: Optional[Callable[[], None]] = None, staged: Any = None) -> Path:
        """Snapshot ``state`` (rank 0) and write it in the background; every rank calls it
        after :meth:`finish`. ``first``: run in the background on every rank before rank 0
        writes the file (waiting for this rank's shards; ``staged``: their host copies, sized
        once, for the memory line); what it returns (a dict) joins the state written.
        Returns the checkpoint's path."""
        frozen = None
        if comm.is_main():
            frozen = self.snapshot.take(state)
            if not self._said_memory:
                self._said_memory = True
                size = state_bytes(staged)
                shards = f" and {_mb(size)} of this rank's shards" if size else ""
                self._say(f"asynchronous checkpoints: a {_mb(self.snapshot.nbytes)} "
                          f"snapshot{shards} in host memory, reused by every save")
        if frozen is not None or first is not None:
            self._done.clear()
            self._error = None
            self._thread = threading.Thread(target=self._run, name="ddpkit-checkpoint-writer",
                                            args=(frozen, directory, step, keep, first),
                                            daemon=False)  # an exit waits for the write
            self._thread.start()
        self.in_flight = step
        return directory / checkpoint_name(step)

    def _run(self, state: Optional[Dict[str, Any]], directory: Path, step: int, keep: int,
             first: Optional[Callable[[], None]]) -> None:
        try:
            more = first() if first is not None else None
            if state is not None:
                self._write({**state, **(more or {})}, directory, step, keep)
        except BaseException as exc:  # noqa: BLE001 - told to every rank at the next question
            self._error = exc
        finally:
            self._done.set()

    def poll(self) -> bool:
        """Whether the save in flight has ended (a collective: rank 0 tells); raises
        :class:`SaveError` on every rank if it failed."""
        if self.in_flight is None:
            return True
        ended = comm.broadcast_object(self._done.is_set() if comm.is_main() else None)
        if ended:
            self.finish()
        return bool(ended)

    def finish(self) -> Optional[float]:
        """Wait for the save in flight (a collective); raise its failure on every rank.
        Returns the seconds waited, or None when nothing was in flight."""
        if self.in_flight is None:
            return None
        began = time.monotonic()
        self.join()
        error: Optional[str] = None
        if comm.is_main() and self._error is not None:
            error = (str(self._error) if isinstance(self._error, DDPKitError) else
                     f"writing checkpoint step {self.in_flight} failed on rank 0: "
                     f"{self._error!r}")
        error = comm.broadcast_object(error)
        self.in_flight = None
        if error is not None:
            raised, self._error = self._error, None
            if isinstance(raised, DDPKitError):
                raise raised
            raise SaveError(error) from raised  # rank 0 prints it; the others leave quietly
        return time.monotonic() - began

    def join(self) -> None:
        """Rank 0: wait for the write thread, without a collective (e.g. after an error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def gathered_rng(group: Any, then: Callable[[], None]) -> Callable[[], Dict[str, Any]]:
    """A ``first`` for :meth:`BackgroundSaver.start`: every rank's RNG state as it is now
    (the step boundary), gathered in the background on ``group`` (a gloo group only this
    thread uses; None alone), then ``then`` (waiting for this rank's shards). The step waits
    for neither collective.

    Example::

        saver.start(state, directory, step, keep, first=gathered_rng(group, complete))
    """
    own = rng_state()

    def first() -> Dict[str, Any]:
        every = [own]
        if group is not None:
            import torch.distributed as dist

            every = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, own, group=group)
        then()
        return {"rng": every}
    return first


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"
