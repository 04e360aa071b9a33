"""Launchers: ``run`` wraps torchrun's own entry point; ``launch`` spawns a function on N ranks.

``run`` is what ``ddpkit run`` calls: it checks the request, then hands over to
``torch.distributed.run`` (the elastic agent: restarts, rendezvous, signal handling) in-process.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
import torch.multiprocessing as mp

from .env import spawn_env, to_environ
from .errors import ConfigError

__all__ = ["RunConfig", "run", "launch", "free_port", "resolve_nproc", "LaunchError"]


class LaunchError(RuntimeError):
    """A worker failed; the message names the rank and carries its traceback."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``.

    Example::

        port = free_port()
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True if ``host:port`` is a local address whose port is taken (False if not local).

    Example::

        if port_in_use("127.0.0.1", 29500): ...
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
        except socket.gaierror:
            return False
    return False


def resolve_nproc(nproc: str | int, cuda_count: Optional[int] = None) -> int:
    """``auto`` means one process per GPU, or one per CPU core without GPUs.

    Example::

        resolve_nproc("auto")   # 2 on a 2-core CPU machine
    """
    if str(nproc) == "auto":
        count = torch.cuda.device_count() if cuda_count is None else cuda_count
        return count or (os.cpu_count() or 1)
    try:
        value = int(nproc)
    except ValueError:
        raise ConfigError(f"--nproc must be a positive integer or 'auto', got {nproc!r}") from None
    if value < 1:
        raise ConfigError(f"--nproc must be >= 1, got {value}")
    return value


@dataclass
class RunConfig:
    """What ``ddpkit run`` was asked for (the CLI parses into this).

    Example::

        RunConfig(script="train.py", script_args=["--epochs", "2"], nproc="2")
    """

    script: str
    script_args: List[str] = field(default_factory=list)
    nproc: str | int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    max_restarts: int = 0
    module: bool = False
    iface: Optional[str] = None
    log_dir: Optional[str] = None
    verbose: bool = False


def _validate(cfg: RunConfig) -> int:
    nproc = resolve_nproc(cfg.nproc)
    if cfg.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {cfg.nnodes}")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ConfigError(f"--node-rank {cfg.node_rank} is impossible with --nnodes "
                          f"{cfg.nnodes} (node ranks run from 0 to {cfg.nnodes - 1})")
    if cfg.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {cfg.max_restarts}")
    if not cfg.module and not os.path.isfile(cfg.script):
        raise ConfigError(f"script {cfg.script!r} does not exist (relative to {os.getcwd()})")
    if cfg.nnodes > 1 and not (cfg.rdzv_endpoint or cfg.master_addr):
        raise ConfigError("several nodes need a meeting point: pass --rdzv-endpoint HOST:PORT "
                          "(or --master-addr/--master-port) with the same value on every node")
    if cfg.master_port is not None and cfg.node_rank == 0:
        host = cfg.master_addr or "127.0.0.1"
        if port_in_use(host, cfg.master_port):
            raise ConfigError(f"master port {cfg.master_port} on {host} is already in use; "
                              "choose another --master-port, or omit it to pick a free one")
    return nproc


def torchrun_args(cfg: RunConfig, nproc: int) -> List[str]:
    """The ``torchrun`` argument list equivalent to ``cfg``.

    Example::

        torchrun_args(RunConfig("t.py", nproc=2), 2)   # ['--nnodes', '1', ...]
    """
    args = ["--nnodes", str(cfg.nnodes), "--nproc-per-node", str(nproc),
            "--max-restarts", str(cfg.max_restarts)]
    if cfg.rdzv_endpoint:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", cfg.rdzv_endpoint,
                 "--rdzv-id", cfg.rdzv_id or "ddpkit"]
    elif cfg.master_addr or cfg.master_port is not None:
        args += ["--node-rank", str(cfg.node_rank),
                 "--master-addr", cfg.master_addr or "127.0.0.1",
                 "--master-port", str(cfg.master_port or 29500)]
    if cfg.log_dir:
        args += ["--log-dir", cfg.log_dir]
    if cfg.module:
        args.append("--module")
    return args + [cfg.script, *cfg.script_args]


def _child_environment(cfg: RunConfig, nproc: int) -> None:
    # Split the cores instead of letting torchrun force one thread per process.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if cfg.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.iface
        os.environ["NCCL_SOCKET_IFNAME"] = cfg.iface


def run(cfg: RunConfig) -> int:
    """Launch ``cfg.script`` on ``nproc`` processes per node through torchrun; returns the exit code.

    Example::

        code = run(RunConfig("train.py", ["--epochs", "1"], nproc=2))
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    nproc = _validate(cfg)
    _child_environment(cfg, nproc)
    if not cfg.verbose:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun(parse_args(torchrun_args(cfg, nproc)))
    except ChildFailedError as exc:
        rank, failure = _root_cause(exc)
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        how = (f"exit code {failure.exitcode}" if failure.exitcode >= 0
               else f"signal {-failure.exitcode}")
        print(f"ddpkit run: rank {rank} failed ({how}); its error is printed above",
              flush=True, file=sys.stderr)
        return code
    return 0


def _root_cause(exc: Any) -> Any:
    """The failure that started it: ranks that recorded an error beat those that lost a peer."""
    recorded = {r: f for r, f in exc.failures.items()
                if isinstance(f.error_file_data.get("message"), dict)}
    if recorded:
        rank = min(recorded, key=lambda r: (recorded[r].timestamp, r))
        return rank, recorded[rank]
    return exc.get_first_failure()


# --------------------------------------------------------------------------- spawn launcher

def _spawned(index: int, fn: Callable[..., Any], args: tuple, nprocs: int, port: int,
             result_dir: str) -> None:
    os.environ.update(to_environ(spawn_env(index, nprocs, "127.0.0.1", port)))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    from .dist import shutdown
    from .runtime import is_peer_failure
    try:
        result = fn(*args)
        if index == 0:
            with open(os.path.join(result_dir, "result.pkl"), "wb") as f:
                pickle.dump(result, f)
    except Exception as exc:
        if is_peer_failure(exc):
            time.sleep(5)  # let the rank that failed first be the one reported (we get stopped)
        raise
    finally:
        shutdown()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: Optional[float] = None,
           start_method: str = "spawn") -> Any:
    """Run ``fn(*args)`` on ``nprocs`` local processes and return rank 0's result.

    Each process sees torchrun-style variables, so ``ddpkit.setup()`` inside ``fn`` just works.
    When one rank fails the others are stopped and its traceback is raised here; past
    ``timeout`` seconds every rank is stopped and :class:`TimeoutError` raised (no hang).
    ``fn`` must be importable (defined in a module) with the default ``spawn`` start method;
    in a notebook pass ``start_method="fork"``.

    Example::

        def train(lr):
            rt = ddpkit.setup()
            ...
            return final_accuracy

        acc = ddpkit.launch(train, 2, 0.1)
    """
    if nprocs < 1:
        raise ConfigError(f"nprocs must be >= 1, got {nprocs}")
    result_dir = tempfile.mkdtemp(prefix="ddpkit-launch-")
    try:
        ctx = mp.start_processes(_spawned, args=(fn, args, nprocs, free_port(), result_dir),
                                 nprocs=nprocs, join=False, start_method=start_method)
        _join(ctx, timeout)
        with open(os.path.join(result_dir, "result.pkl"), "rb") as f:
            return pickle.load(f)
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)


def _join(ctx: Any, timeout: Optional[float]) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.2):
            if deadline is not None and time.monotonic() > deadline:
                _terminate(ctx)
                raise TimeoutError(f"ranks still running after {timeout:.0f} s; all stopped")
    except mp.ProcessRaisedException as exc:
        raise LaunchError(f"rank {exc.error_index} failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise LaunchError(f"rank {exc.error_index} exited with code {exc.exit_code}") from None


def _terminate(ctx: Any) -> None:
    for proc in ctx.processes:
        with contextlib.suppress(Exception):
            if proc.is_alive():
                proc.kill()
    for proc in ctx.processes:
        proc.join(5)
