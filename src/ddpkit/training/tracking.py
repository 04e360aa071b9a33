"""``rt.log``: metrics to the run directory's JSONL and to the trackers a user chose
(TensorBoard, MLflow, Weights & Biases), with a history that stays exact across resumes.

Rank 0 writes; every rank may call it. A resumed run continues the same tracker run: its key is
drawn by rank 0 and kept in every checkpoint. Each record remembers the optimizer steps taken
when it was logged (its position); a run resumed from the checkpoint of step G runs again what
came after G, so what the crashed attempt logged after G is replaced, not repeated:

- trackers that can rewrite (the JSONL file, TensorBoard) are written at once; on resume the
  JSONL keeps the records of positions up to G, TensorBoard purges the steps after them;
- trackers that only append (MLflow, W&B) get a record once a checkpoint at or past its
  position is on disk, or when the loop ends (``ckpt.close()``, the end of ``fit``), or at
  once when no checkpointer is open. A crash loses nothing there: the resumed run logs those
  steps again.

Example::

    rt = ddpkit.setup(log_to=["tensorboard", "mlflow"], log_dir="runs/exp1")
    ...
    rt.log({"train/loss": rt.mean(loss), "lr": sched.get_last_lr()[0]})   # step: optimizer steps
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..base.errors import ConfigError
from ..engines import comm
from .log import _cannot_write

__all__ = ["Tracking", "TRACKERS", "tracker_names", "with_tensorboard"]

#: name -> (module to import, the extra that installs it)
TRACKERS: Dict[str, Tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}

Record = Tuple[int, int, float, Dict[str, Any]]  # position, step, time, metrics


def tracker_names(log_to: Union[str, Sequence[str], None]) -> List[str]:
    """``log_to`` as a list of tracker names (``"mlflow,wandb"`` or a list), each checked: an
    unknown name or a tracker whose package is missing is one :class:`ConfigError` line.

    Example::

        tracker_names("tensorboard,mlflow")   # ['tensorboard', 'mlflow']
    """
    if not log_to:
        return []
    names = [n.strip().lower() for n in (log_to.split(",") if isinstance(log_to, str)
                                         else log_to) if n and n.strip()]
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"log_to: unknown tracker {name!r}; choose from "
                              f"{', '.join(TRACKERS)} (metrics.jsonl is always written)")
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"log_to {name}: the {module} package is not installed; "
                              f"pip install 'ddpkit[{extra}]'")
    return list(dict.fromkeys(names))


def with_tensorboard(log_to: Union[str, Sequence[str], None]) -> List[str]:
    """``log_to``'s names with TensorBoard added when its package is installed (``ddpkit
    train`` writes it by default).

    Example::

        with_tensorboard("mlflow")   # ['mlflow', 'tensorboard'] with tensorboard installed
    """
    names = tracker_names(log_to)
    if "tensorboard" not in names and importlib.util.find_spec("tensorboard") is not None:
        names.append("tensorboard")
    return names


def _number(value: Any) -> Any:
    """A tensor of one element as a Python number; other values as they are."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "numel", lambda: 0)() == 1:
        return item()
    return value


def _numeric(metrics: Mapping[str, Any]) -> Dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class _Jsonl:
    """``<log_dir>/metrics.jsonl``, one record a line (``pos``: its position); on resume from
    the checkpoint of step ``upto`` the records of later positions are cut."""

    rewrites = True

    def __init__(self, log_dir: Path, upto: Optional[int]) -> None:
        self.path = log_dir / "metrics.jsonl"
        self.kept: List[Record] = []  # the records kept, for trackers that may lack some
        if upto is not None and self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines(keepends=True):
                try:
                    record = json.loads(line)
                    pos = int(record.get("pos", record["step"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by the crash
                if pos <= upto:
                    kept.append(line if line.endswith("\n") else line + "\n")
                    step = int(record.pop("step"))
                    record.pop("pos", None)
                    self.kept.append((pos, step, float(record.pop("time", 0.0)), record))
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)

    @property
    def last_kept(self) -> Optional[int]:
        """The largest step kept by a resume's cut (TensorBoard purges the steps after it)."""
        return max((step for _, step, _, _ in self.kept), default=None)

    def write(self, records: List[Record]) -> None:
        if self._file is None:
            return
        try:
            for pos, step, t, metrics in records:
                self._file.write(json.dumps({"step": step, "pos": pos, "time": round(t, 3),
                                             **metrics}, default=str) + "\n")
        except OSError as exc:  # a full disk: said once, training goes on
            _cannot_write(str(self.path), exc)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            _close_quietly(self._file)
            self._file = None


def _close_quietly(handle: Any) -> None:
    # on a full disk the last flush fails as well: the failed write was the one said
    try:
        handle.close()
    except OSError:
        pass


class _TensorBoard:
    """``<log_dir>/tensorboard``; on resume the steps after the checkpoint's are purged."""

    rewrites = True

    def __init__(self, log_dir: Path, purge_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self._tb = SummaryWriter(str(log_dir / "tensorboard"), purge_step=purge_step)

    def write(self, records: List[Record]) -> None:
        if self._tb is None:
            return
        try:
            for _, step, t, metrics in records:
                for key, value in _numeric(metrics).items():
                    self._tb.add_scalar(key, value, step, walltime=t)
        except OSError as exc:
            _cannot_write(self._tb.log_dir, exc)
            self.close()

    def close(self) -> None:
        if self._tb is not None:
            _close_quietly(self._tb)
            self._tb = None


class _MLflow:
    """One MLflow run per ddpkit run (tag ``ddpkit.run_key``), found again on resume.
    ``MLFLOW_TRACKING_URI`` as MLflow reads it, else a SQLite store ``<log_dir>/mlflow.db``
    (MLflow 3 refuses its old file store, ``mlruns/``, unless told to allow it)."""

    rewrites = False

    def __init__(self, log_dir: Path, key: str, project: str) -> None:
        from mlflow.tracking import MlflowClient
        uri = (os.environ.get("MLFLOW_TRACKING_URI")
               or f"sqlite:///{(log_dir / 'mlflow.db').resolve()}")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        exp_id = (experiment.experiment_id if experiment is not None
                  else self.client.create_experiment(project))
        found = self.client.search_runs([exp_id], f"tags.`ddpkit.run_key` = '{key}'",
                                        max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                exp_id, tags={"ddpkit.run_key": key}, run_name=f"ddpkit-{key}").info.run_id

        self.sent_through = -1  #: every record of this position or before is stored

    def write(self, records: List[Record]) -> None:
        from mlflow.entities import Metric
        metrics = [Metric(k, v, int(t * 1000), step)
                   for _, step, t, m in records for k, v in _numeric(m).items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        self.sent_through = max([self.sent_through] + [r[0] for r in records])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _WandB:
    """A W&B run whose id is the ddpkit run's key (``resume="allow"``); offline when no API
    key is set (``wandb sync`` uploads it later)."""

    rewrites = False

    def __init__(self, log_dir: Path, key: str, project: str) -> None:
        import wandb
        mode = os.environ.get("WANDB_MODE") or None  # set but empty: as unset
        if mode is None and not os.environ.get("WANDB_API_KEY"):
            mode = "offline"
            comm.print0(f"log_to wandb: no WANDB_API_KEY: writing offline under {log_dir}/wandb "
                        "(`wandb sync` uploads it)")
        self.run = wandb.init(project=project, id=key, resume="allow", dir=str(log_dir),
                              mode=mode, settings=wandb.Settings(silent=True))
        # a step's row is held here until a later step comes, then committed whole
        self._row: Dict[str, float] = {}
        self._row_step: Optional[int] = None
        self._committed = -1  # the last position written
        # W&B's own service writes the run's file a while after run.log returns, and dies
        # with the process on kill -9 (an attempt's file then held nothing): what it stored is
        # known only once run.finish() returns. Until then a resume sends this attempt's
        # records again; W&B keeps a step's first value (the same value: the training resumed
        # exactly), so a point is never missing, at worst written twice
        self.sent_through = -1

    def write(self, records: List[Record]) -> None:
        for pos, step, _, metrics in records:
            if self._row_step is not None and step != self._row_step:
                self._commit()
            if self._row_step is None:
                self._row_step = step
            self._row.update(_numeric(metrics))
            self._committed = max(self._committed, pos)

    def _commit(self) -> None:
        if self._row_step is not None:
            self.run.log(self._row, step=self._row_step, commit=True)
        self._row, self._row_step = {}, None

    def close(self) -> None:
        self._commit()
        self.sent_through = self._committed
        self.run.finish()


class Tracking:
    """The run's metrics log behind :meth:`Runtime.log <ddpkit.training.runtime.Runtime.log>`
    and ``fit``'s logging: the JSONL file, TensorBoard, MLflow, W&B.

    ``log_to``: tracker names (:data:`TRACKERS`); ``position``: the optimizer steps taken so
    far (``setup`` gives the heartbeat's count, restored on resume); ``chosen``: the user
    asked for it (``fit`` then logs here by itself). Its state (the tracker
    run's key, the position) goes into each checkpoint; the checkpointer calls :meth:`saved`
    once a checkpoint is on disk and :meth:`loop_ended` when the loop is over.

    Example::

        tracking = Tracking("runs/exp1", ["mlflow"])
        tracking.log({"train/loss": 0.42}, step=100)
        tracking.close()
    """

    def __init__(self, log_dir: Union[str, Path], log_to: Sequence[str] = (),
                 key: Optional[str] = None, project: Optional[str] = None,
                 position: Optional[Callable[[], int]] = None, chosen: bool = True) -> None:
        self.log_dir = Path(log_dir)
        self.chosen = chosen  #: asked for (setup's log_to / log_dir): ``fit`` logs here too
        self.trackers = list(log_to)
        self.key = key or secrets.token_hex(4)
        self.project = project or "ddpkit"
        self._position = position or (lambda: 0)
        self._resumed_at: Optional[int] = None  # the step of the checkpoint resumed from
        self._sinks: Optional[List[Any]] = None  # opened at the first write (rank 0)
        self._named: Dict[str, Any] = {}  # the trackers' writers by name
        self._deferring = 0         # checkpointers open: append-only trackers wait for saves
        self._pending: List[Record] = []   # for them, past the newest checkpoint on disk
        self._saving: Optional[int] = None  # the position of the checkpoint being written
        self._durable = -1          # the newest checkpoint on disk's position
        self._closed = False

    # ------------------------------------------------------------------ logging
    def log(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        """Record ``metrics`` at ``step`` (default: its position); rank 0 writes, any rank
        may call it.

        Example::

            tracking.log({"eval/top1": 91.2}, step=500)
        """
        if not isinstance(metrics, Mapping):
            raise ConfigError(f"rt.log takes a dict of metrics, not {type(metrics).__name__}: "
                              "rt.log({'train/loss': loss})")
        pos = int(self._position() or 0)
        record = (pos, pos if step is None else int(step), time.time(),
                  {str(k): _number(v) for k, v in metrics.items()})
        if not comm.is_main() or self._closed:
            return
        sinks = self._open()
        for sink in sinks:
            if sink.rewrites:
                sink.write([record])
        self._pending.append(record)
        if not self._deferring or pos <= self._durable:
            self._flush(pos)

    def _open(self) -> List[Any]:
        if self._sinks is not None:
            return self._sinks
        self.log_dir.mkdir(parents=True, exist_ok=True)
        jsonl = _Jsonl(self.log_dir, self._resumed_at)
        self._named = {name: self._tracker(name, jsonl) for name in self.trackers}
        self._sinks = [jsonl, *self._named.values()]
        if self._resumed_at is not None:  # what the crashed attempt may not have stored
            sent = self._sent()
            for name, sink in self._named.items():
                replay = [r for r in jsonl.kept if r[0] > sent.get(name, -1)]
                if not sink.rewrites and replay:
                    sink.write(replay)  # all covered by the checkpoint resumed from
            self._mark()
        return self._sinks

    def _tracker(self, name: str, jsonl: _Jsonl) -> Any:
        """The writer of tracker ``name`` (``rewrites``, ``write(records)``, ``close()``)."""
        if name == "tensorboard":  # a resume: the steps after those kept are purged
            purge = None if self._resumed_at is None else \
                (0 if jsonl.last_kept is None else jsonl.last_kept + 1)
            return _TensorBoard(self.log_dir, purge)
        return {"mlflow": _MLflow, "wandb": _WandB}[name](self.log_dir, self.key, self.project)

    @property
    def _marker(self) -> Path:
        return self.log_dir / ".ddpkit-sent.json"

    def _sent(self) -> Dict[str, int]:
        """Tracker name -> the position through which it stored every record of this run (an
        earlier attempt's, from the marker it left; none: nothing)."""
        try:
            marker = json.loads(self._marker.read_text())
            if marker.get("key") != self.key:
                return {}
            return {str(k): int(v) for k, v in marker["sent"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _flush(self, upto: Optional[int] = None) -> None:
        """Append-only trackers get the pending records of positions up to ``upto`` (all:
        None); the marker then says how far they got (a resume sends what is past it)."""
        if not self._pending or self._sinks is None:
            return
        ready = [r for r in self._pending if upto is None or r[0] <= upto]
        if not ready:
            return
        self._pending = [r for r in self._pending if upto is not None and r[0] > upto]
        for sink in self._sinks:
            if not sink.rewrites:
                sink.write(ready)
        self._mark()

    def _mark(self) -> None:
        """Write how far each append-only tracker has stored this run's records."""
        sent = {name: sink.sent_through for name, sink in self._named.items()
                if not sink.rewrites}
        if not sent:
            return
        tmp = self._marker.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"key": self.key, "sent": sent}))
            os.replace(tmp, self._marker)
        except OSError:  # a full disk: a resume may send some records again
            pass

    # ------------------------------------------------------------------ the checkpointer's side
    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps: the tracker run's key and the position it was taken at."""
        self._saving = int(self._position() or 0)
        return {"key": self.key, "pos": self._saving}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A resume: the same tracker runs; what was logged after the checkpoint is replaced."""
        if self._sinks is not None and state["key"] != self.key:
            raise ConfigError("rt.log was called before rt.checkpointer(...) resumed the run: "
                              "create the checkpointer first, so the trackers continue the "
                              "resumed run")
        self.key = str(state["key"])
        self._resumed_at = self._durable = int(state["pos"])
        self._pending = []

    def attach(self) -> None:
        """A checkpointer opened: append-only trackers wait for its saves."""
        self._deferring += 1

    def saved(self) -> None:
        """The checkpoint whose state was taken last is on disk: what it covers is final."""
        if self._saving is not None:
            self._durable = max(self._durable, self._saving)
            self._flush(self._durable)

    def loop_ended(self) -> None:
        """A checkpointer closed without an error: everything logged is final."""
        self._deferring = max(0, self._deferring - 1)
        if not self._deferring:
            self._flush()

    def close(self, final: bool = True) -> None:
        """The end of the run: every tracker closed. ``final`` (``fit``: its loop ended without
        an error): every record goes out; else (at exit) those that an open checkpointer's
        checkpoints do not cover are dropped: a loop that did not reach ``ckpt.close()``
        crashed, and the run that resumes logs them again.

        Example::

            tracking.close()
        """
        if self._closed:
            return
        if self._sinks is None and self._resumed_at is not None and comm.is_main() \
                and any(name in ("mlflow", "wandb") for name in self.trackers):
            self._open()  # a resumed run that logged nothing: what was not sent goes now
        self._closed = True
        if final or not self._deferring:
            self._flush()
        for sink in self._sinks or []:
            sink.close()
        self._mark()  # W&B's last row is committed now
