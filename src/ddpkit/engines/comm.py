"""Rank utilities that work the same with one process or many: reduce, gather, print on rank 0.

Each function asks the engine that serves this process (:func:`ddpkit.engines.active`) and falls
back to the single-process answer when there is no group, so user code never needs an
``if distributed:`` branch.
"""
from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import warnings
from typing import Any, Iterator, List, Union

import torch

from . import active
from .base import REDUCE_OPS

__all__ = ["rank", "world_size", "is_main", "barrier", "reduce", "gather_object",
           "broadcast_object", "print0", "main_process_first", "install_rank_warnings"]

Number = Union[int, float]


def rank() -> int:
    """Global rank of this process (0 without a process group).

    Example::

        if rank() == 0: ...
    """
    return active().rank()


def world_size() -> int:
    """Number of processes in the job (1 without a process group).

    Example::

        per_rank = global_batch // world_size()
    """
    return active().world_size()


def is_main() -> bool:
    """True on global rank 0: the process that logs and writes files.

    Example::

        if is_main():
            torch.save(state, "model.pt")
    """
    # a fault-tolerant run's replicas are jobs of one process: the quorum's first one leads
    return rank() == 0 and getattr(active(), "leads", lambda: True)()


def barrier() -> None:
    """Wait until every rank gets here. Every rank must call it, never just one.

    Example::

        barrier()
    """
    active().barrier()


def reduce(value: Union[torch.Tensor, Number], op: str = "sum") -> Union[torch.Tensor, Number]:
    """All-reduce a tensor or a plain number across ranks with ``sum``, ``mean``, ``max`` or ``min``.

    Tensors come back on their own device and dtype; numbers come back as Python numbers.
    Every rank must call it. To average a metric, reduce a (sum, count) pair rather than means.

    Example::

        total = reduce(torch.tensor([loss_sum, count]), "sum")
        slowest = reduce(step_seconds, "max")
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")
    is_tensor = isinstance(value, torch.Tensor)
    tensor = value if is_tensor else torch.tensor(value, dtype=torch.float64)
    tensor = active().all_reduce(tensor, op)
    if is_tensor:
        return tensor
    out = tensor.item()
    return int(out) if isinstance(value, int) and op != "mean" else out


def gather_object(obj: Any) -> List[Any]:
    """Gather any picklable object from every rank; returns the list in rank order on all ranks.

    Objects may differ in size and shape between ranks (unlike tensor ``all_gather``).

    Example::

        counts = gather_object(len(my_shard))   # [n0, n1, ...]
    """
    return active().all_gather_object(obj)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send rank ``src``'s object to every rank and return it.

    Example::

        run_dir = broadcast_object(make_run_dir() if is_main() else None)
    """
    return active().broadcast_object(obj, src)


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (flushes, so logs interleave correctly under launchers).

    Example::

        print0(f"epoch {epoch}: loss {loss:.4f}")
    """
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Run the block on rank 0 first, then on the other ranks (e.g. to prepare a dataset once).

    Example::

        with main_process_first():
            dataset = load_or_prepare(cache_dir)
    """
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()


def install_rank_warnings(rank_: int) -> None:
    """Show each warning once per job: library warnings (torch, ddpkit, any installed package)
    from rank 0 only, since every rank raises them alike; the script's own warnings on other
    ranks once each, prefixed ``[rank k]``.

    Example::

        install_rank_warnings(env.rank)
    """
    if rank_ == 0:
        return
    original = warnings.showwarning
    seen: set = set()

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        key = (str(message), category, filename, lineno)
        if key in seen or _library_file(filename) or _raised_by_library():
            return
        seen.add(key)
        text = f"[rank {rank_}] {message}"
        original(text, category, filename, lineno, file if file is not None else sys.stderr, line)

    warnings.showwarning = show


_WARNINGS_FILES = ("warnings.py", "_py_warnings.py")  # the module, and its 3.14 home


def _raised_by_library() -> bool:
    # The code that called warnings.warn (the warning itself may name the user's line, as
    # torch's do with stacklevel): the first frame above us outside the warnings module.
    frame = sys._getframe(2)
    while frame is not None and os.path.basename(frame.f_code.co_filename) in _WARNINGS_FILES:
        frame = frame.f_back
    return frame is not None and _library_file(frame.f_code.co_filename)


def _library_file(filename: str) -> bool:
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.abspath(filename)
    return filename.startswith("<frozen") or any(path.startswith(r + os.sep) for r in roots if r)
