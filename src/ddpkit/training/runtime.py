"""The facade: ``setup()`` returns a :class:`Runtime` that wraps models, builds loaders, reduces.

This is the "five lines" a plain PyTorch script adds; every method delegates to a module that
does one job (engines, env, dist, data, comm, evaluate).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import Dataset

from ..engines import comm
from .. import engines
from ..base import observe
from .batches import to_device
from ..faults.crash import install_error_hook
from ..data.live import live_loader
from ..data.loader import DistributedLoader, make_loader
from ..data.slices import SliceLoader
from ..checkpoint import ray_train
from ..env.dist import DEFAULT_TIMEOUT, cpu_threads_per_process, select_device
from ..env.detect import BACKEND_VAR, TIMEOUT_VAR, ClusterEnv
from .evaluation import evaluate
from ..base.errors import ConfigError
from .tracking import Tracking, tracker_names
from ..faults import stall
from ..faults.launcher_watch import start_for_launcher
from ..faults.watch_store import watch_store
from ..faults.hangs import Heartbeat
from ..checkpoint.checkpointer import Checkpointer
from ..base.seed import seed_everything, set_deterministic
from ..faults.stops import Stops
from ..base.wrap import WrapOptions, check_not_wrapped, compile_model, unwrap

__all__ = ["Runtime", "setup"]


class Runtime:
    """This process's place in the job, its engine, and the helpers that depend on them.

    Create it with :func:`setup`. Use it as a context manager to shut the process group down
    even when training raises.

    Example::

        with ddpkit.setup() as rt:
            model = rt.wrap(Net())
            loader = rt.loader(train_set, batch_size=256)
            for epoch in range(10):
                for x, y in loader:
                    x, y = rt.to_device(x, y)
                    ...
            rt.print0("done")
    """

    def __init__(self, env: ClusterEnv, device: torch.device, backend: Optional[str],
                 engine: Optional[engines.Engine] = None, stops: Optional[Stops] = None,
                 heartbeat: Optional[Heartbeat] = None,
                 tracking: Optional[Tracking] = None) -> None:
        self.env, self.device, self.backend = env, device, backend
        #: what :meth:`log` writes to (its checkpoint state: see :mod:`.tracking`)
        self.tracking = tracking or Tracking(_default_log_dir(env), chosen=False,
                                             position=lambda: self.heartbeat.last_step or 0)
        self.engine = engine or engines.create("ddp")
        self.stops = stops or Stops()  # not installed: signals keep their default meaning
        self.heartbeat = heartbeat or Heartbeat(None, env.rank, env.world_size)
        # The user modules wrapped so far: wrapping one twice is refused at the call (weak, so
        # a copy of a wrapped model, an EMA or a teacher, is a new module and wraps fine).
        self._wrapped: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()

    rank = property(lambda self: self.env.rank, doc="Global rank.")
    local_rank = property(lambda self: self.env.local_rank, doc="Rank on this node.")
    world_size = property(lambda self: self.env.world_size, doc="Number of processes.")
    is_main = property(lambda self: self.env.rank == 0 and getattr(self.engine, "leads",
                                                                    lambda: True)(),
                       doc="True on global rank 0 (a fault-tolerant run: on the replica that "
                           "leads the step's quorum).")

    def wrap(self, model: nn.Module, engine: Optional[str] = None, **options: Any) -> nn.Module:
        """Move to this rank's device and wrap it the engine's way; see :class:`WrapOptions`.

        ``engine`` (``ddp`` | ``fsdp`` | ``dp`` | ``horovod`` | ``none``) wraps this one model another way
        than the engine chosen by :func:`setup` (``setup(engine=...)`` chooses for the whole
        run); under the Horovod engine ``ddp`` means ``horovod``, so a script runs unchanged
        under ``horovodrun`` (then also pass the optimizer to :meth:`optimizer`).

        Example::

            model = rt.wrap(Net(), sync_bn=True)
            model = rt.wrap(Net(), compile=True)   # torch.compile over the DDP module
        """
        if "strategy" in options:  # the old name of the argument
            warnings.warn("rt.wrap(strategy=...) is now rt.wrap(engine=...); the old name still "
                          "works", FutureWarning, stacklevel=2)
            engine = engine or options.pop("strategy")
        check_not_wrapped(model, self._wrapped.get(unwrap(model)))
        chosen = self.engine
        if engine is not None and not chosen.serves(engine):
            chosen = engines.create(engine)
        opts = WrapOptions(**options)
        watch = observe.active()
        if watch is not None:  # ddpkit verify: before DDP takes its copy of the parameters
            watch.model(model)
        wrapped = chosen.wrap(model, self.env, self.device, opts)
        self._wrapped[unwrap(wrapped)] = type(wrapped).__name__
        return compile_model(wrapped, self.device, opts.compile_mode) if opts.compile else wrapped

    def loader(self, dataset: Dataset, batch_size: Optional[int] = None,
               **kwargs: Any) -> DistributedLoader:
        """A loader of this rank's share; ``batch_size`` is the *global* batch of one optimizer
        step (with ``accum_steps=K``, each batch it gives is one of the K micro-batches of a
        step: the one rule, in ``ddpkit/data/batch.py``). ``per_rank_batch=N`` instead: each
        rank's micro-batch (Accelerate's and Fabric's ``batch_size``), the global batch
        what it makes. The split, decided here once, is ``loader.batch``;
        ``loader.batch_size`` is torch's, this rank's micro-batch. See :func:`make_loader`.

        Example::

            loader = rt.loader(train_set, batch_size=256, num_workers=2, seed=0)
            loader = rt.loader(train_set, batch_size=256, accum_steps=4)  # 64 / ranks a batch
            loader = rt.loader(train_set, per_rank_batch=16)   # 16 a rank: 32 on 2 ranks
            loader.batch   # Batch(global_batch=256, world_size=..., accum_steps=4, micro_batch=...)
        """
        per_rank = kwargs.get("per_rank_batch")
        if batch_size is None and per_rank is None:
            raise ConfigError("rt.loader needs batch_size= (the global batch of one optimizer "
                              "step) or per_rank_batch= (each rank's micro-batch)")
        if batch_size is not None and per_rank is not None:
            raise ConfigError(f"rt.loader: batch_size={batch_size} (global) and per_rank_batch="
                              f"{per_rank} (each rank's) both given: give one")
        batch_size = 0 if batch_size is None else batch_size  # per_rank_batch decides
        live = engines.live.current()
        if live is not None:  # a fault-tolerant run: each step split over the live replicas
            return live_loader(dataset, batch_size, live, **kwargs)
        return make_loader(dataset, batch_size, self.env, device=self.device, **kwargs)

    def slices(self, tokens: torch.Tensor, batch_size: int, bptt: int) -> SliceLoader:
        """A language model's loader without a Dataset (PyTorch's word_language_model):
        ``tokens``, one long 1-D tensor, laid out as ``batch_size`` columns (the global batch)
        and read ``bptt`` rows at a time; this rank reads its own adjacent columns, so N ranks
        read together what one process reads. ``rt.checkpointer(loader=...)`` keeps its place
        (epoch, row); keep the recurrent state per rank in ``extra=``. See
        :class:`~ddpkit.data.slices.SliceLoader` and ``examples/lm_bptt.py``.

        Example::

            train = rt.slices(train_tokens, batch_size=20, bptt=35)
            for x, y in train:          # x: (35, 20 / world) token ids, y: the next ones
                ...
        """
        if engines.live.current() is not None:
            raise ConfigError("rt.slices cannot follow replicas that come and go "
                              "(--fault-tolerant): its columns are split over a fixed world; "
                              "use rt.loader on a Dataset, or run without --fault-tolerant")
        return SliceLoader(tokens, batch_size, bptt, self.rank, self.world_size)

    def to_device(self, *batches: Any) -> Any:
        """Move tensors, or batches of any structure (tuples, lists, dicts), to this rank's
        device: one in, one out; several in, a tuple out.

        Example::

            x, y = rt.to_device(x, y)
            batch = rt.to_device({"input_ids": ids, "labels": ids})
        """
        moved = tuple(to_device(b, self.device) for b in batches)
        return moved[0] if len(moved) == 1 else moved

    def mean(self, value: Any) -> float:
        """The mean of ``value`` (a number or a tensor's mean) over all ranks, on every rank: the
        number to log, the same at any world size for equal shards. Collective: every rank
        calls it.

        Example::

            rt.print0(f"step {step}: loss {rt.mean(loss):.4f}")   # not rank 0's shard alone
        """
        if torch.is_tensor(value):
            value = value.detach().float().mean()
            return float(comm.reduce(value.reshape(1).to(torch.float64), "mean"))
        return float(comm.reduce(float(value), "mean"))

    def evaluate(self, model: nn.Module, data: Dataset, **kwargs: Any) -> dict:
        """Exact distributed evaluation on this rank's device; see :func:`ddpkit.evaluate`.

        Example::

            metrics = rt.evaluate(model, test_set, per_rank_batch=256)
        """
        kwargs.setdefault("device", self.device)
        return evaluate(model, data, **kwargs)

    def optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                  accum_steps: int = 1, compression: Optional[str] = None) -> torch.optim.Optimizer:
        """The optimizer to step: unchanged under DDP; Horovod's ``DistributedOptimizer`` under
        the Horovod engine (gradient averaging, ``accum_steps`` backward passes per all-reduce,
        optional ``compression="fp16"``, rank 0's state broadcast).

        Example::

            opt = rt.optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        """
        return self.engine.optimizer(optimizer, model, accum_steps, compression)

    def log(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        """Log ``metrics`` (numbers, or one-element tensors) at ``step`` (default: the
        optimizer steps taken so far, a resumed run's included): rank 0 appends them to
        ``<log_dir>/metrics.jsonl`` and the trackers of ``setup(log_to=...)``. Values are
        what you pass: use :meth:`mean` for the mean over ranks. Call it on every rank or on
        rank 0 only. With :meth:`checkpointer`, a resumed run continues the same tracker runs
        and replaces what the crashed attempt logged after its last checkpoint (see
        docs/tracking.md).

        Example::

            rt.log({"train/loss": rt.mean(loss), "lr": scheduler.get_last_lr()[0]})
        """
        self.tracking.log(metrics, step)

    def checkpointer(self, directory: Optional[str], *, model: nn.Module,
                     **parts: Any) -> Checkpointer:
        """Exact save and resume for your own loop; see :class:`~ddpkit.checkpoint.checkpointer.Checkpointer`.
        Resumes at once when ``resume`` (default ``"auto"``) finds a checkpoint in ``directory``.

        Example::

            with rt.checkpointer("runs/x/ckpt", model=model, optimizer=opt, loader=loader,
                                 every_steps=100) as ckpt:
                for epoch in range(ckpt.epoch, 10):
                    for x, y in loader:
                        ...; opt.step()
                        ckpt.step()   # saves when due; saves and stops on SIGTERM / SIGUSR1
        """
        return Checkpointer(self, directory, model=model, **parts)

    print0 = staticmethod(comm.print0)
    barrier = staticmethod(comm.barrier)
    reduce = staticmethod(comm.reduce)
    gather_object = staticmethod(comm.gather_object)
    broadcast_object = staticmethod(comm.broadcast_object)
    main_process_first = staticmethod(comm.main_process_first)
    unwrap = staticmethod(unwrap)

    def shutdown(self) -> None:
        """Leave the job (also done at exit): destroy the process group; under Horovod
        ``hvd.join`` + shutdown.

        Example::

            rt.shutdown()
        """
        stall.stop_current()  # its thread uses the group's store
        self.tracking.close(final=False)  # a checkpointer still open: its loop did not end
        self.engine.shutdown()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"Runtime(rank={self.rank}/{self.world_size}, local_rank={self.local_rank}, "
                f"device={self.device}, backend={self.backend}, engine={self.engine.name}, "
                f"launcher={self.env.launcher})")


def _default_log_dir(env: Optional[ClusterEnv] = None) -> str:
    """``runs/<script name>``: where ``rt.log`` writes without ``setup(log_dir=...)``; under
    Ray Train Ray's run storage (a worker's working directory is in Ray's session directory)."""
    under_ray = ray_train.log_dir() if env is not None and ray_train.running(env) else None
    if under_ray is not None:
        return under_ray
    stem = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c", "-") else ""
    return os.path.join("runs", stem or "ddpkit")


def _rank_hint(environ: Mapping[str, str]) -> int:
    """This process's rank as the launcher's variables say, before they are checked."""
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        with contextlib.suppress(KeyError, ValueError):
            return int(environ[name])
    return 0


def _watch_for_stalls(heartbeat: Heartbeat, store: Any, world_size: int,
                      timeout: timedelta) -> None:
    """A rank the others wait for is named within seconds (:mod:`.faults.stall`), on one node or
    several; ``DDPKIT_STALL_AFTER=0`` (``ddpkit run --stall-after 0``) turns it off."""
    after = stall.after_from_env()
    if after > 0 and world_size > 1 and store is not None:
        watch = stall.StallWatch(heartbeat, watch_store(store), after=after,
                                 timeout=timeout.total_seconds()).start()
        atexit.register(watch.stop)  # after the group's exit handler: runs before it
        launcher = start_for_launcher(after, watch.store_wait)
        if launcher is not None:
            atexit.register(launcher.stop)


def setup(*, backend: Optional[str] = None, init_method: Optional[str] = None,
          timeout: Optional[timedelta] = None, accelerator: str = "auto",
          seed: Optional[int] = None, deterministic: bool = False,
          env: Optional[ClusterEnv] = None, expected_world_size: Optional[int] = None,
          argv: Optional[Sequence[str]] = None, engine: str = "auto",
          log_to: Union[str, Sequence[str], None] = None, log_dir: Optional[str] = None,
          project: Optional[str] = None) -> Runtime:
    """Detect the launcher, pick the device, create the process group: the first ddpkit line.

    Works unchanged under torchrun / ``ddpkit run``, Slurm ``srun``, :func:`ddpkit.launch` and a
    plain ``python script.py`` (one process, no process group). Idempotent. ``backend`` defaults to
    ``DDPKIT_BACKEND`` (``ddpkit run --backend``), else NCCL on GPUs and gloo on CPUs;
    ``timeout`` (a collective's) to ``DDPKIT_TIMEOUT`` seconds (``ddpkit run --timeout``), else
    10 minutes. ``engine`` is
    ``auto`` (Horovod under ``horovodrun``, else DDP), ``ddp``, ``dp``, ``horovod`` or ``none``:
    see :mod:`ddpkit.engines`. ``log_to``: trackers for :meth:`Runtime.log` besides
    ``<log_dir>/metrics.jsonl`` (``"tensorboard"``, ``"mlflow"``, ``"wandb"``, a list or
    comma-separated; each an extra, ``pip install 'ddpkit[mlflow]'``); ``log_dir`` defaults to
    ``runs/<script name>`` (under Ray Train: ``<storage_path>/<run name>/log``); ``project``:
    the MLflow experiment / W&B project (``ddpkit``).

    Example::

        rt = ddpkit.setup(seed=0)
        print(rt)   # Runtime(rank=0/2, local_rank=0, device=cpu, backend=gloo, engine=ddp, ...)
    """
    trackers = tracker_names(log_to)  # a bad name or a missing package: one line, at once
    chosen = engines.create("ddp") if engine == "auto" and env is not None \
        else engines.choose(engine)  # an explicit env is a torch job (tests, custom launchers)
    install_error_hook(_rank_hint(os.environ))  # a job set up wrongly: one line, not a traceback
    env = chosen.environment(env, sys.argv if argv is None else argv, expected_world_size)
    stops = Stops()
    # a rank of a job (a fault-tolerant replica too: a job of one among the others)
    if (env.is_distributed or chosen.name == "live") and "ipykernel" not in sys.modules:
        stops.install()  # a rank of a job; one process (a script, a notebook) keeps Ctrl-C as is
    install_error_hook(env.rank, stops=stops)  # before init: a bad backend is one line as well
    comm.install_rank_warnings(env.rank)
    backend = backend or os.environ.get(BACKEND_VAR) or None  # `ddpkit run --backend`
    if timeout is None:  # `ddpkit run --timeout`, else 10 minutes
        seconds = os.environ.get(TIMEOUT_VAR)
        timeout = timedelta(seconds=float(seconds)) if seconds else DEFAULT_TIMEOUT
    device = select_device(env, accelerator, backend=backend)
    threads = cpu_threads_per_process(env) if device.type == "cpu" else None
    if threads:
        torch.set_num_threads(threads)
    backend_name = chosen.start(env, device, backend, init_method, timeout)
    # One node only: there the store lives with the local agent, so reading it on a hang or at
    # exit cannot block on an unreachable node.
    single_node = env.num_nodes == 1
    heartbeat = Heartbeat(chosen.store() if single_node else None, env.rank,
                        env.world_size).started()
    heartbeat.watch_optimizers()  # a script's own loop: hang reports name its last optimizer step
    if heartbeat.store is not None:  # registered after the group's exit handler: runs first
        atexit.register(heartbeat.leaving)
    _watch_for_stalls(heartbeat, chosen.store(), env.world_size, timeout)
    if backend_name is not None:  # PyTorch wrapped the hook at init; ours goes on top
        install_error_hook(env.rank, stops=stops, heartbeat=heartbeat, single_node=single_node,
                           timeout_s=timeout.total_seconds())
    if seed is not None:
        seed_everything(seed)
    if deterministic:
        set_deterministic(True)
    observe.start(env.rank, env.world_size, seeded=seed is not None)  # under ddpkit verify
    tracking = Tracking(log_dir or _default_log_dir(env), trackers, project=project,
                        position=lambda: heartbeat.last_step or 0,
                        chosen=bool(trackers or log_dir))
    atexit.register(tracking.close, final=False)
    return Runtime(env, device, backend_name, chosen, stops, heartbeat, tracking)
