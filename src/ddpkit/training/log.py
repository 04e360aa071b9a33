"""Rank-0 logging: start-up banner, metrics as JSONL (and TensorBoard when installed), progress bar.

Every function here is safe to call on all ranks; only rank 0 writes or prints.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, TypeVar

import torch

from ..engines import comm

__all__ = ["banner", "RunLogger", "progress_bar", "format_epoch"]

T = TypeVar("T")


def banner(env: Any, device: torch.device, backend: Optional[str]) -> str:
    """Lightning-style start-up lines for every rank, printed once by rank 0; returns the text.

    Printed for the first start only: after an elastic restart (``TORCHELASTIC_RESTART_COUNT``)
    ``ddpkit run`` has said which rank failed and how, and the script says what it resumed
    from; the same lines again would bury that. Collective: every rank must call it.

    Example::

        banner(rt.env, rt.device, rt.backend)
        # Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2 (local rank 0, device cpu)
    """
    me = {"rank": env.rank, "local": env.local_rank, "node": env.node_rank, "device": str(device),
          "host": os.uname().nodename, "threads": torch.get_num_threads()}
    everyone = comm.gather_object(me)  # on every start: restart counts can differ by node
    if env.restart_count:
        return ""
    lines = [f"Initializing distributed: GLOBAL_RANK: {r['rank']}, MEMBER: {r['rank'] + 1}/"
             f"{env.world_size} (node {r['node']} {r['host']}, local rank {r['local']}, "
             f"device {r['device']}, {r['threads']} threads)" for r in everyone]
    sep = "-" * 80
    lines += [sep, f"distributed_backend={backend or 'none'} launcher={env.launcher}",
              f"All distributed processes registered. Starting with {env.world_size} processes",
              sep]
    text = "\n".join(lines)
    comm.print0(text)
    return text


class RunLogger:
    """Metrics to ``<run_dir>/metrics.jsonl`` (one JSON object a line) and TensorBoard, rank 0 only.

    Example::

        log = RunLogger("runs/exp1")
        log.log({"train/loss": 0.42}, step=100)
        log.close()
    """

    def __init__(self, run_dir: str, tensorboard: bool = True) -> None:
        self.enabled = comm.is_main()
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:  # tensorboard is an optional extra
                self._tb = None

    def log(self, metrics: Dict[str, Any], step: int) -> None:
        """Append one record; numeric values also go to TensorBoard."""
        if not self.enabled or self._file is None:
            return
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as exc:  # a full disk: say so once and train on; the checkpoint says more
            _cannot_write(self._file.name, exc)
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self._tb is not None:
            try:
                for key, value in metrics.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._tb.add_scalar(key, value, step)
            except OSError as exc:  # its writer thread's error, raised again here
                self._drop_tensorboard(exc)

    def close(self) -> None:
        """Flush and close the files."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # a full disk was said when a write failed
                self._file.close()
            self._file = None
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as exc:
                self._drop_tensorboard(exc)
            self._tb = None

    def _drop_tensorboard(self, exc: OSError) -> None:
        """Stop writing TensorBoard events after a write failed (a full disk), as for JSONL."""
        _cannot_write(self._tb.log_dir, exc)
        with contextlib.suppress(OSError):
            self._tb.close()
        self._tb = None


def _cannot_write(path: str, exc: OSError) -> None:
    """One warning for metrics that can no longer be written; training goes on."""
    print(f"warning: cannot append to {path} ({exc.strerror or exc}): metrics are no longer "
          "recorded there; training goes on", file=sys.stderr, flush=True)


class _Plain:
    """Stands in for a tqdm bar where none is shown."""

    def __init__(self, iterable: Iterable[T]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[T]:
        return iter(self.iterable)

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(iterable: Iterable[T], total: Optional[int], desc: str, enabled: bool = True,
             samples_per_item: int = 1) -> Any:
    """A tqdm bar on rank 0 when stderr is a terminal; a plain wrapper otherwise.

    Both have ``set_postfix`` and ``close``.

    Example::

        bar = progress_bar(loader, len(loader), "epoch 1")
        for batch in bar:
            bar.set_postfix(loss=0.1)
    """
    if not (enabled and comm.is_main() and sys.stderr.isatty()):
        return _Plain(iterable)
    from tqdm.auto import tqdm
    # Counted in global samples, so the rate tqdm shows is the job's throughput.
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True,
                unit="img", unit_scale=samples_per_item)


def format_scores(m: Dict[str, Any]) -> List[str]:
    """An evaluation's scores beside its loss: top-k accuracies in percent, then the others
    (perplexity, R^2, ...).

    Example::

        format_scores({"eval/loss": 0.7, "eval/top1": 89.4, "eval/perplexity": 2.01})
        # ['top1 89.40%', 'perplexity 2.01']
    """
    evals = [(k[5:], v) for k, v in m.items() if k.startswith("eval/") and isinstance(v, float)]
    return ([f"{k} {v:.2f}%" for k, v in evals if k.startswith("top")]
            + [f"{k} {v:.4g}" for k, v in evals
               if not k.startswith("top") and k not in ("loss", "count")])


def format_epoch(m: Dict[str, float], epochs: int) -> str:
    """One line per epoch: loss, accuracy, throughput.

    Example::

        format_epoch({"epoch": 1, "train/loss": 0.5}, 10)   # 'epoch 1/10  loss 0.5000'
    """
    if m.get("train/samples") == 0:  # resumed from a checkpoint at the epoch's last batch
        parts = [f"epoch {m['epoch']}/{epochs}", "(its training was done before the resume)"]
    else:
        parts = [f"epoch {m['epoch']}/{epochs}", f"loss {m['train/loss']:.4f}"]
    if "eval/loss" in m:
        parts.append("  ".join([f"eval loss {m['eval/loss']:.4f}", *format_scores(m),
                                f"({m['eval/count']} targets)"]))
    if "train/samples_per_s" in m and m.get("train/samples") != 0:
        parts.append(f"{m['train/samples_per_s']:.0f} samples/s  step {m['train/step_ms']:.1f} ms")
    return "  ".join(parts)
