"""Process-group set-up and tear-down: device, backend, init method, timeout, threads.

Everything here takes a :class:`~ddpkit.env.ClusterEnv`; nothing reads the environment itself
except :func:`cpu_threads_per_process`, which honours the user's ``OMP_NUM_THREADS``.
"""
from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as tdist
from torch.distributed.rendezvous import rendezvous

from .env import ClusterEnv
from .errors import ConfigError

__all__ = ["select_device", "check_gpu_sharing", "resolve_backend", "resolve_init_method",
           "check_master_resolves",
           "init_process_group", "shutdown", "DEFAULT_TIMEOUT"]

#: Collective timeout. PyTorch's default of 30 minutes turns a dead peer into half an hour of
#: silence; 10 minutes still leaves room for a slow first-epoch data preparation.
DEFAULT_TIMEOUT = timedelta(minutes=10)

BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def select_device(env: ClusterEnv, accelerator: str = "auto",
                  cuda_count: Optional[int] = None, backend: Optional[str] = None) -> torch.device:
    """The device this process owns: ``cuda:<local_rank mod #GPUs>`` when CUDA is there, else CPU.

    More processes than GPUs on a node are refused under NCCL (it needs one GPU per process)
    and allowed with ``backend="gloo"``: the processes then share the GPUs, which exercises
    DDP on one GPU (a functional test, not a speed-up); local rank 0 says so in one line.

    Example::

        device = select_device(env)          # cuda:1 for local rank 1 on a 2-GPU node
        device = select_device(env, "cpu")   # force CPU
        device = select_device(env, backend="gloo")   # 2 ranks on 1 GPU: both on cuda:0
    """
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown accelerator {accelerator!r}; use auto, cpu or cuda")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if accelerator == "cpu" or (accelerator == "auto" and count == 0):
        return torch.device("cpu")
    if count == 0:
        raise ConfigError("accelerator 'cuda' was requested but no CUDA device is visible; "
                          "use --accelerator cpu or check CUDA_VISIBLE_DEVICES")
    if env.local_world_size > count:
        check_gpu_sharing(env.local_world_size, count, backend)
        if env.local_rank == 0:
            print(f"note: {env.local_world_size} processes share {count} GPU(s) over gloo: "
                  "right for testing DDP on one machine, not for speed", file=sys.stderr,
                  flush=True)
    return torch.device("cuda", env.local_rank % count)


def check_gpu_sharing(processes: int, gpus: int, backend: Optional[str]) -> None:
    """Raise a :class:`ConfigError` unless ``processes`` per node may share ``gpus`` GPUs: only
    the gloo backend can (NCCL needs one GPU per process).

    Example::

        check_gpu_sharing(2, 1, "gloo")   # fine: both ranks on cuda:0
        check_gpu_sharing(4, 2, None)     # ConfigError: use --nproc 2, or --backend gloo
    """
    if processes <= gpus or backend == "gloo":
        return
    why = "NCCL" if backend in (None, "", "auto", "nccl") else f"backend {backend!r}"
    raise ConfigError(f"{processes} processes on this node but only {gpus} CUDA device(s): "
                      f"{why} needs one GPU per process; use --nproc {gpus} (or auto), or "
                      "--backend gloo to let processes share a GPU (for testing, not speed)")


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """nccl for CUDA, gloo otherwise; an explicit choice is checked against the device.

    Example::

        resolve_backend(None, torch.device("cpu"))      # 'gloo'
        resolve_backend("nccl", torch.device("cpu"))    # ConfigError: nccl needs CUDA
    """
    if backend in (None, "", "auto"):
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} "
                          "or leave it unset for automatic choice")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("backend 'nccl' needs CUDA devices but this process runs on CPU; "
                          "use --backend gloo (or leave it unset)")
    return backend


def resolve_init_method(env: ClusterEnv, init_method: Optional[str] = None) -> str:
    """The init method URL: explicit ``env://``, ``tcp://h:p`` or ``file://path``, else derived.

    Without one, torchrun's own ``env://`` is used under torchrun; Slurm and spawn get an explicit
    ``tcp://master:port`` so nothing has to be written into ``os.environ``.

    Example::

        resolve_init_method(env, "file:///shared/job42.init")
    """
    if init_method:
        if not init_method.startswith(("env://", "tcp://", "file://")):
            raise ConfigError(f"init method {init_method!r} must start with env://, tcp:// or "
                              "file://")
        if init_method.startswith("env://") and not env.master_addr:
            raise ConfigError("init method env:// needs MASTER_ADDR and MASTER_PORT")
        return init_method
    if not env.master_addr or env.master_port is None:
        raise ConfigError(f"world size {env.world_size} needs a master address and port "
                          "(MASTER_ADDR/MASTER_PORT, or an init method such as file:///shared/f)")
    if env.launcher == "torchrun":
        return "env://"
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    return f"tcp://{host}:{env.master_port}"


def check_master_resolves(env: ClusterEnv) -> None:
    """Raise one :class:`ConfigError` if the master's host name names no address here.

    Under Slurm the master is the step's first node *name*; where node names are not host names
    (DNS knows the nodes by other names) every rank would otherwise wait for a store it cannot
    find, until the timeout. Whether a name resolves can differ between nodes, so every rank that
    cannot resolve it says so.

    Example::

        check_master_resolves(env)   # before connecting to tcp://master:port
    """
    host = env.master_addr or ""
    try:
        socket.getaddrinfo(host, env.master_port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        where = (f"the first node of the Slurm nodelist {env.nodelist}" if env.nodelist
                 else "MASTER_ADDR")
        raise ConfigError(f"master host {host!r} ({where}) does not resolve on this node "
                          f"({exc.args[-1] if exc.args else exc}); export MASTER_ADDR=<its "
                          f"address> in the job script (`scontrol show node {host}` shows its "
                          "NodeAddr), or fix DNS / /etc/hosts") from None


def cpu_threads_per_process(env: ClusterEnv, environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """Intra-op threads for a CPU process, or None to leave torch's choice alone.

    N processes each using every core fight for them; split the cores unless the user said
    ``OMP_NUM_THREADS`` explicitly.

    Example::

        torch.set_num_threads(cpu_threads_per_process(env) or torch.get_num_threads())
    """
    if "OMP_NUM_THREADS" in environ or env.local_world_size <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // env.local_world_size)


def init_process_group(env: ClusterEnv, device: torch.device, backend: Optional[str] = None,
                       init_method: Optional[str] = None,
                       timeout: timedelta = DEFAULT_TIMEOUT) -> Optional[str]:
    """Create the default process group (idempotent); returns the backend, or None for 1 process.

    On CUDA the device is selected before the group exists, so NCCL never touches GPU 0 from
    every rank. The group is destroyed at interpreter exit if the user does not do it first.

    Example::

        backend = init_process_group(env, torch.device("cpu"), timeout=timedelta(minutes=2))
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not env.is_distributed:
        return None
    resolved = resolve_backend(backend, device)
    if tdist.is_initialized():
        return tdist.get_backend()
    url = resolve_init_method(env, init_method)
    if env.launcher == "slurm" and url.startswith("tcp://"):
        check_master_resolves(env)  # a name that does not resolve: one line, not a long wait
    if url == "env://" and env.restart_count > 0 and env.shared_store:
        # After an elastic restart the agent's shared store still holds the previous attempt's
        # addresses; a rank reading one of those connects to a dead peer. Namespace by attempt.
        # (Without a shared store every round has a fresh one, and restart counts can differ
        # between nodes, so no prefix: `ddpkit run` on several nodes works that way.)
        store, rank, world = next(rendezvous(url, timeout=timeout))
        store = tdist.PrefixStore(f"ddpkit/attempt{env.restart_count}", store)
        tdist.init_process_group(resolved, store=store, rank=rank, world_size=world,
                                 timeout=timeout)
    else:
        kwargs = {} if url == "env://" else {"rank": env.rank, "world_size": env.world_size}
        tdist.init_process_group(resolved, init_method=url, timeout=timeout, **kwargs)
    _register_exit_handler()
    return resolved


def _register_exit_handler() -> None:
    atexit.unregister(_shutdown_at_exit)  # once per process, however often a group is created
    atexit.register(_shutdown_at_exit)


def _shutdown_at_exit(grace: float = 0.2) -> None:
    # Destroy the group while the interpreter is fully alive, then give gloo's worker threads a
    # moment to drop the last collectives they hold. A worker that releases a tensor with a
    # Python object after finalization has begun needs the GIL it can no longer get, and the
    # process dies with "terminate called without an active exception" (SIGABRT) although the
    # script succeeded: a rank that leaves right after its last collective (the ones that do
    # not save the model) hits it on a loaded machine. pytorch/pytorch#179291 has the analysis.
    shutdown()
    gc.collect()
    time.sleep(grace)


def shutdown() -> None:
    """Destroy the default process group if there is one (safe to call many times).

    Example::

        try:
            train()
        finally:
            shutdown()
    """
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
