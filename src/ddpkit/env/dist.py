"""Process-group set-up and tear-down: device, backend, init method, timeout, threads.

Everything here takes a :class:`~ddpkit.env.detect.ClusterEnv`; nothing reads the environment itself
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

from .detect import JOIN_TIMEOUT_VAR, ClusterEnv
from ..base.errors import ConfigError

__all__ = ["select_device", "check_gpu_sharing", "resolve_backend", "resolve_init_method",
           "check_master_resolves",
           "init_process_group", "shutdown", "DEFAULT_TIMEOUT", "JOIN_TIMEOUT"]

#: Collective timeout. PyTorch's default of 30 minutes turns a dead peer into half an hour of
#: silence; 10 minutes still leaves room for a slow first-epoch data preparation.
DEFAULT_TIMEOUT = timedelta(minutes=10)

#: Seconds that processes no launcher vouches for (:attr:`ClusterEnv.vouched`: RANK/WORLD_SIZE
#: often left over in a shell) wait for each other at start-up, unless ``DDPKIT_JOIN_TIMEOUT``
#: says otherwise. A launcher's processes keep the collective timeout: its nodes may
#: legitimately start minutes apart.
JOIN_TIMEOUT = 60.0
#: What to unset to run one process: every variable that makes a process a rank of a job.
STALE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")
_JOINED = "ddpkit/joined"  # how many processes have come to the store

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
    if (not env.master_addr or env.master_port is None) and not env.vouched:
        raise ConfigError(_claim_failed(env, "no MASTER_ADDR/MASTER_PORT says where they meet",
                                        late=False))
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
    if init_method is None and not env.vouched:
        store = _join_store(env, timeout)  # no launcher behind the variables: a short wait
        tdist.init_process_group(resolved, store=store, rank=env.rank,
                                 world_size=env.world_size, timeout=timeout)
    elif url == "env://" and env.restart_count > 0 and env.shared_store:
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


def _join_store(env: ClusterEnv, timeout: timedelta) -> tdist.Store:
    """The store of a job no launcher vouches for, once every process has come to it.

    torch's env:// waits for the others in native code, where Ctrl-C cannot reach it, for the
    whole collective timeout, and then raises a long DistStoreError. Here each wait is a short
    Python step, so Ctrl-C ends it at once (ddpkit.faults.stops), and a job whose processes do not all
    come within the join timeout ends with one line naming the variables that claimed it.
    """
    wait = env.join_timeout or min(JOIN_TIMEOUT, timeout.total_seconds())
    deadline = time.monotonic() + wait
    store = _serve(env, timeout) if env.rank == 0 else _connect(env, deadline, timeout, wait)
    joined = _count(store, 1, env)
    while joined < env.world_size:
        if time.monotonic() >= deadline:
            raise ConfigError(_claim_failed(env, f"{joined} of {env.world_size} processes "
                                                 f"joined within {wait:g} s"))
        time.sleep(0.1)
        joined = _count(store, 0, env)
    return store


def _serve(env: ClusterEnv, timeout: timedelta) -> tdist.Store:
    # Rank 0 serves the store (as torch's env:// does) but does not wait inside its constructor.
    try:
        return tdist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False)
    except tdist.DistError:
        raise ConfigError(_claim_failed(env, f"port {env.master_port} is already in use on "
                                             "this machine")) from None


def _connect(env: ClusterEnv, deadline: float, timeout: timedelta, wait: float) -> tdist.Store:
    # A plain socket probes for rank 0 first: a TCPStore client that finds nobody logs a C++
    # stack trace at every attempt, and blocks Ctrl-C while it retries.
    where = f"{env.master_addr}:{env.master_port}"
    while True:
        try:
            socket.create_connection((env.master_addr, env.master_port), timeout=1.0).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise ConfigError(_claim_failed(env, f"no rank 0 answered at {where} within "
                                                     f"{wait:g} s")) from None
            time.sleep(0.2)
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    try:
        store = tdist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=left,
                               wait_for_workers=False)
    except tdist.DistError:
        raise ConfigError(_claim_failed(env, f"what answered at {where} is not rank 0's "
                                             "store")) from None
    store.set_timeout(timeout)
    return store


def _count(store: tdist.Store, add: int, env: ClusterEnv) -> int:
    try:
        return store.add(_JOINED, add)
    except tdist.DistError:
        raise ConfigError(_claim_failed(env, f"rank 0 at {env.master_addr}:{env.master_port} "
                                             "went away before every process joined")) from None


def _claim_failed(env: ClusterEnv, what: str, late: bool = True) -> str:
    """One line: the variables that claimed a job, what did not happen, what to do (``late``:
    and how to wait longer, where the others may just be slow to start)."""
    claim = " ".join(f"{name}={value}" for name, value in (
        ("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("MASTER_ADDR", env.master_addr),
        ("MASTER_PORT", env.master_port)) if value not in (None, ""))
    wait = (f" ({JOIN_TIMEOUT_VAR}=SECONDS waits longer for processes that start late)" if late
            else "")
    return (f"{claim} say this is rank {env.rank} of a job of {env.world_size}, but {what}: "
            f"unset them (unset {' '.join(STALE_VARS)}) to run on one process, or launch with "
            f"{_launch_hint(env.world_size)}{wait}")


def _launch_hint(world: int) -> str:
    script = sys.argv[0] if sys.argv else ""
    if script.endswith(".py") and os.path.basename(script) != "__main__.py":
        return f"ddpkit run --nproc {world} {script}"  # the user's own script, as typed
    return f"ddpkit run --nproc {world} script.py (the built-in job: ddpkit train --nproc {world})"


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
