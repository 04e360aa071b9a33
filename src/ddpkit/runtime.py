"""The facade: ``setup()`` returns a :class:`Runtime` that wraps models, builds loaders, reduces.

This is the "five lines" a plain PyTorch script adds; every method delegates to a module that
does one job (env, dist, wrap, data, comm, evaluate).
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from . import comm, horovod_engine
from .data import DistributedLoader, make_loader
from .dist import (DEFAULT_TIMEOUT, cpu_threads_per_process, init_process_group, select_device,
                   shutdown)
from .env import ClusterEnv, detect
from .errors import DDPKitError
from .evaluate import evaluate
from .seed import seed_everything, set_deterministic
from .wrap import WrapOptions, unwrap, wrap_model

__all__ = ["Runtime", "setup", "die_with_launcher", "collective_timeout"]


class Runtime:
    """This process's place in the job plus the helpers that depend on it.

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
            rt.print("done")
    """

    def __init__(self, env: ClusterEnv, device: torch.device, backend: Optional[str]) -> None:
        self.env, self.device, self.backend = env, device, backend

    rank = property(lambda self: self.env.rank, doc="Global rank.")
    local_rank = property(lambda self: self.env.local_rank, doc="Rank on this node.")
    world_size = property(lambda self: self.env.world_size, doc="Number of processes.")
    is_main = property(lambda self: self.env.rank == 0, doc="True on global rank 0.")

    def wrap(self, model: nn.Module, strategy: str = "ddp", **options: Any) -> nn.Module:
        """Move to this rank's device and wrap (``ddp`` | ``dp`` | ``horovod`` | ``none``); see
        :class:`WrapOptions`. Under the Horovod engine ``ddp`` means ``horovod``, so a script
        runs unchanged under ``horovodrun`` (then also pass the optimizer to :meth:`optimizer`).

        Example::

            model = rt.wrap(Net(), sync_bn=True)
        """
        if self.backend == "horovod" and strategy == "ddp":
            strategy = "horovod"
        return wrap_model(model, self.env, self.device, strategy, WrapOptions(**options))

    def loader(self, dataset: Dataset, batch_size: int, **kwargs: Any) -> DistributedLoader:
        """A loader of this rank's share; ``batch_size`` is the *global* batch. See :func:`make_loader`.

        Example::

            loader = rt.loader(train_set, batch_size=256, num_workers=2, seed=0)
        """
        return make_loader(dataset, batch_size, self.env, device=self.device, **kwargs)

    def to_device(self, *tensors: torch.Tensor) -> Any:
        """Move tensors to this rank's device (one tensor in, one out; several in, a tuple out).

        Example::

            x, y = rt.to_device(x, y)
        """
        moved = tuple(t.to(self.device, non_blocking=True) for t in tensors)
        return moved[0] if len(moved) == 1 else moved

    def evaluate(self, model: nn.Module, data: Dataset, **kwargs: Any) -> dict:
        """Exact distributed evaluation on this rank's device; see :func:`ddpkit.evaluate`.

        Example::

            metrics = rt.evaluate(model, test_set, batch_size=256)
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
        if self.backend != "horovod" or not horovod_engine.is_active():
            return optimizer
        return horovod_engine.distributed_optimizer(optimizer, unwrap(model), accum_steps,
                                                    compression)

    print = staticmethod(comm.print0)
    barrier = staticmethod(comm.barrier)
    reduce = staticmethod(comm.reduce)
    gather = staticmethod(comm.gather_object)
    main_process_first = staticmethod(comm.main_process_first)
    unwrap = staticmethod(unwrap)

    def shutdown(self) -> None:
        """Destroy the process group (also done at exit); under Horovod: ``hvd.join`` + shutdown."""
        horovod_engine.shutdown()
        shutdown()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"Runtime(rank={self.rank}/{self.world_size}, local_rank={self.local_rank}, "
                f"device={self.device}, backend={self.backend}, launcher={self.env.launcher})")


def setup(*, backend: Optional[str] = None, init_method: Optional[str] = None,
          timeout: timedelta = DEFAULT_TIMEOUT, accelerator: str = "auto",
          seed: Optional[int] = None, deterministic: bool = False,
          env: Optional[ClusterEnv] = None, expected_world_size: Optional[int] = None,
          argv: Optional[Sequence[str]] = None, engine: str = "auto") -> Runtime:
    """Detect the launcher, pick the device, create the process group: the first ddpkit line.

    Works unchanged under torchrun / ``ddpkit run``, Slurm ``srun``, :func:`ddpkit.launch` and a
    plain ``python script.py`` (one process, no process group). Idempotent. Under ``horovodrun``
    (or ``engine="horovod"``) Horovod replaces the process group: see :mod:`ddpkit.horovod_engine`.

    Example::

        rt = ddpkit.setup(seed=0)
        print(rt)   # Runtime(rank=0/2, local_rank=0, device=cpu, backend=gloo, launcher=torchrun)
    """
    if engine not in ("auto", "torch", "horovod"):
        raise DDPKitError(f"unknown engine {engine!r}; choose auto, torch or horovod")
    horovod = engine == "horovod" or (engine == "auto" and env is None
                                      and horovod_engine.started_by_horovod(os.environ))
    if horovod:
        env = horovod_engine.init()  # hvd.init() takes the place of the process group
    else:
        die_with_launcher()
        env = env or detect(os.environ, sys.argv if argv is None else argv, expected_world_size)
    install_error_hook(env.rank)  # before init too: a bad backend must be one line as well
    comm.install_rank_warnings(env.rank)
    device = select_device(env, accelerator)
    threads = cpu_threads_per_process(env) if device.type == "cpu" else None
    if threads:
        torch.set_num_threads(threads)
    if horovod:
        backend_name: Optional[str] = "horovod"
    else:
        backend_name = init_process_group(env, device, backend, init_method, timeout)
        if backend_name is not None:
            install_error_hook(env.rank)  # PyTorch wrapped the hook at init; ours goes outermost
    if seed is not None:
        seed_everything(seed)
    if deterministic:
        set_deterministic(True)
    return Runtime(env, device, backend_name)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher(environ: Optional[dict] = None, sig: int = signal.SIGKILL) -> bool:
    """In a worker of ``ddpkit run``: have the kernel send ``sig`` when the launcher dies.

    torchrun starts workers in their own session, so a killed launcher (``kill -9``, OOM
    killer) leaves them running: on several nodes the job then fails only after torchrun's
    300 s exit barrier. Applies only when ``DDPKIT_LAUNCHER_PID`` (set by ``ddpkit run``) is
    this process's parent; a no-op returning False elsewhere (other launchers, not Linux).

    Example::

        die_with_launcher()   # True in a worker of `ddpkit run` on Linux
    """
    environ = os.environ if environ is None else environ
    launcher = environ.get("DDPKIT_LAUNCHER_PID", "")
    if not sys.platform.startswith("linux") or not launcher.isdigit():
        return False
    if os.getppid() != int(launcher):
        return False  # started by something else (e.g. a grandchild of the launcher)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != int(launcher):  # the launcher died before prctl took effect
        os.kill(os.getpid(), sig)
    return True


_TIMEOUT_PATTERNS = (
    # gloo: "[.../unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation to complete"
    re.compile(r"Timed out waiting (?P<ms>\d+)\s*ms for (?P<what>\w+) operation"),
    # NCCL watchdog: "... WorkNCCL(SeqNum=7, OpType=ALLREDUCE, ...) ran for 600012 milliseconds
    # before timing out" / "Timeout(ms)=600000"
    re.compile(r"OpType=(?P<op>\w+).*?Timeout\(ms\)=(?P<ms>\d+)", re.S),
)


def collective_timeout(exc: BaseException, tb: Any = None) -> Optional[str]:
    """One line for a collective that timed out (gloo or NCCL), or None for other errors.

    Names the collective (from the traceback: ``all_reduce``, ``barrier``, DDP's gradient
    all-reduce in ``backward``...), where the script called it, the timeout, and what to check.

    Example::

        collective_timeout(RuntimeError("[x.cc:78] Timed out waiting 6000ms for recv operation "
                                        "to complete"))
        # 'a collective timed out after 6 s (...): a peer rank stopped answering: ...'
    """
    text = str(exc)
    match = next((m for m in (p.search(text) for p in _TIMEOUT_PATTERNS) if m), None)
    if match is None:
        return None
    seconds = int(match.group("ms")) / 1000
    op, where = _collective_site(tb if tb is not None else exc.__traceback__)
    if op is None and match.groupdict().get("op"):
        op = match.group("op").lower()
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0])[:160]  # no src loc
    if "gloo" in text.lower():
        detail = f"gloo: {detail}"
    return (f"{'collective ' + op if op else 'a collective'} timed out after {seconds:g} s "
            f"({'called at ' + where + '; ' if where else ''}{detail}): a peer rank stopped "
            "answering: check the network between the nodes (or pass --iface NAME), that every "
            "node is still running (the first error on another node is the cause), or raise "
            "ddpkit.setup(timeout=...)")


def _collective_site(tb: Any) -> "tuple[Optional[str], Optional[str]]":
    """(collective name, "file:line" in the caller's code) from a traceback, innermost first."""
    if tb is None:
        return None, None
    frames = traceback.extract_tb(tb)
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    ours = os.path.dirname(os.path.abspath(__file__)) + os.sep
    op = None
    for frame in reversed(frames):
        name = frame.name
        if frame.filename.endswith("distributed_c10d.py") and not name.startswith("_") \
                and name != "wrapper":
            op = name
            break
        if frame.filename.startswith(torch_dir) and name in ("backward", "_engine_run_backward"):
            op = "gradient all-reduce in backward (DDP)"
            break
    outside = [f for f in frames if not f.filename.startswith(torch_dir)]
    user = next((f for f in reversed(outside) if not f.filename.startswith(ours)), None)
    inner = outside[-1] if outside else None
    where = f"{os.path.basename(user.filename)}:{user.lineno}" if user else None
    if inner is not None and inner is not user and inner.filename.startswith(ours):
        via = f"ddpkit.{os.path.splitext(os.path.basename(inner.filename))[0]}.{inner.name}"
        where = f"{where} via {via}" if where else via
    return op, where


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because another rank died first: a consequence, not the cause."""
    text = str(exc)
    return any(marker in text for marker in _PEER_LOST)


def _record_root_cause(exc: BaseException, text: str) -> None:
    # torchrun's error file, in its own format, names the rank that failed first (see
    # ddpkit.launchers.run); ranks that merely lost a peer write none.
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # reporting must never mask the real error
        pass


def install_error_hook(rank: int, delay: float = 3.0) -> None:
    """Report an uncaught error once instead of once per rank.

    Rank 0 reports at once; other ranks wait ``delay`` seconds first, by which time a launcher
    that saw rank 0 fail has stopped them, so an error every rank hits is printed once. A
    :class:`DDPKitError` is one line (no traceback) and exit status 2; a collective that failed
    only because a peer died is one line too, so the failing rank's traceback stands out; a
    collective that timed out is one line on every rank (:func:`collective_timeout`).
    Install it after the process group exists: PyTorch wraps ``sys.excepthook`` at init.

    Example::

        install_error_hook(env.rank)
    """
    def hook(kind: type, value: BaseException, tb: Any) -> None:
        prefix = "" if rank == 0 else f"[rank {rank}] "
        if is_peer_failure(value):
            first = str(value).strip().splitlines()[0][:200]
            _write(f"{prefix}stopped: a peer process failed during a collective ({first})\n")
            os._exit(1)
        timed_out = collective_timeout(value, tb)
        if timed_out is not None:
            # Every rank of a cut-off node times out alike: one line each, at once (no delay:
            # on several nodes each launcher sees only its own ranks).
            text = "".join(traceback.format_exception(kind, value, tb))
            _record_root_cause(value, text)
            _write(f"{prefix}error: {timed_out}\n")
            os._exit(1)
        if rank != 0:
            time.sleep(delay)
        text = "".join(traceback.format_exception(kind, value, tb))
        _record_root_cause(value, text)
        if isinstance(value, DDPKitError):
            _write(f"{prefix}error: {value}\n")
            os._exit(2)
        _write("".join(prefix + line + "\n" for line in text.splitlines()))
        os._exit(1)

    hook.ddpkit = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _write(text: str) -> None:
    stream = sys.__stderr__ or sys.stderr
    stream.write(text)
    stream.flush()
