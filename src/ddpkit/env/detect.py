"""Cluster environment detection: who am I, how many of us, where is the master.

A pure function of a mapping (normally ``os.environ``) and ``argv``: no side effects, so every
launcher (torchrun, Slurm, spawn, a single process) is testable with a plain dict.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from ..base.errors import ConfigError, JobSetupError
from .k8s import PodLaunch, pod_launch
from .slurm import (first_host, parse_tasks_per_node, port_from_job_id, step_id,
                        step_tasks_per_node)

__all__ = ["ClusterEnv", "detect", "spawn_env", "to_environ", "JOIN_TIMEOUT_VAR", "BACKEND_VAR",
           "TIMEOUT_VAR"]

#: The process group backend for ``ddpkit.setup()`` calls that name none (``ddpkit run
#: --backend``, ``ddpkit verify --backend`` set it for their ranks): ``gloo`` lets the ranks of
#: one node share its GPU(s), for testing.
BACKEND_VAR = "DDPKIT_BACKEND"
#: Seconds a collective may wait for ``ddpkit.setup()`` calls that name no timeout (``ddpkit run
#: --timeout`` sets it for its ranks).
TIMEOUT_VAR = "DDPKIT_TIMEOUT"

#: Seconds processes that no launcher vouches for wait for each other at start-up (see
#: :attr:`ClusterEnv.vouched`); ``ddpkit.env.dist`` uses 60 s (or less, with a shorter timeout).
JOIN_TIMEOUT_VAR = "DDPKIT_JOIN_TIMEOUT"
#: Set by :func:`to_environ` for the ranks of ``ddpkit.launch``: a launcher stands behind them.
_SPAWNED_VAR = "DDPKIT_SPAWNED"
#: Variables that say a launcher started this process with the torchrun-style ones: torchrun's
#: agent (also ``ddpkit run``, ``torch.distributed.launch``), ``ddpkit.launch``, MPI, and
#: Kubernetes (operators such as PyTorchJob set RANK/WORLD_SIZE; pods start minutes apart).
#: Set in every process a Ray cluster starts: under RANK/WORLD_SIZE, a Ray Train worker (its
#: TorchTrainer made the process group before the training function runs).
_RAY_MARK = "RAY_RAYLET_PID"
_LAUNCHER_MARKS = ("TORCHELASTIC_RUN_ID", _SPAWNED_VAR, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                   "PMIX_RANK", "KUBERNETES_SERVICE_HOST", _RAY_MARK)


@dataclass(frozen=True)
class ClusterEnv:
    """Where this process sits in the job.

    Example::

        env = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
        assert env.rank == 1 and env.is_distributed
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    launcher: str = "single"  # torchrun | slurm | kubernetes | ray | spawn | adopted | single
    restart_count: int = 0
    job_id: Optional[str] = None
    #: torchrun workers reuse the agent's rendezvous store (TORCHELASTIC_USE_AGENT_STORE=True);
    #: ``ddpkit run`` on several nodes turns that off: a fresh store per rendezvous round.
    shared_store: bool = False
    #: Slurm: the step's hostlist, where ``master_addr`` (its first host) came from.
    nodelist: Optional[str] = None
    #: Nodes in the job when the launcher says (torchrun's GROUP_WORLD_SIZE, the srun step's
    #: node count); otherwise :attr:`num_nodes` assumes as many processes on every node.
    nodes: Optional[int] = None
    #: False for RANK/WORLD_SIZE that no launcher stands behind (see ``_LAUNCHER_MARKS``): often
    #: left over in a shell, so the processes get a short time to meet, not the collective
    #: timeout (``ddpkit.env.dist``). True for anything built by hand (tests, custom launchers).
    vouched: bool = True
    #: Seconds to wait at start-up for every process to join when not :attr:`vouched`
    #: (``DDPKIT_JOIN_TIMEOUT``); None: the default of ``ddpkit.env.dist``.
    join_timeout: Optional[float] = None

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        """Number of nodes: as the launcher says, else assuming as many processes on each (the
        same on every rank either way, so ranks can decide on it alike)."""
        if self.nodes is not None:
            return self.nodes
        return max(1, self.world_size // max(1, self.local_world_size))

    def validate(self) -> "ClusterEnv":
        """Raise :class:`ConfigError` on impossible combinations; return self."""
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank {self.rank} is impossible with world size {self.world_size} "
                f"(ranks run from 0 to {self.world_size - 1}); check RANK/WORLD_SIZE ({self.launcher})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(
                f"local rank {self.local_rank} is impossible with {self.local_world_size} processes "
                f"on this node; check LOCAL_RANK/LOCAL_WORLD_SIZE ({self.launcher})")
        if self.local_world_size > self.world_size:
            raise ConfigError(
                f"{self.local_world_size} processes per node exceed world size {self.world_size}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"master port {self.master_port} is not a TCP port (1-65535)")
        return self


def _int(environ: Mapping[str, str], key: str, default: Optional[int] = None) -> Optional[int]:
    raw = environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {key}={raw!r} is not an integer") from None


def _legacy_local_rank(argv: Sequence[str]) -> Optional[int]:
    """``torch.distributed.launch`` passed ``--local_rank=N`` (or ``--local-rank N``) to scripts."""
    for i, arg in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if arg == flag and i + 1 < len(argv):
                return int(argv[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return None


def _from_torchrun(environ: Mapping[str, str], argv: Sequence[str]) -> ClusterEnv:
    world = _int(environ, "WORLD_SIZE", 1)
    local_rank = _int(environ, "LOCAL_RANK")
    if local_rank is None:
        local_rank = _legacy_local_rank(argv)
    return ClusterEnv(
        rank=_int(environ, "RANK", 0),
        world_size=world,
        local_rank=local_rank or 0,
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE", world),
        node_rank=_int(environ, "GROUP_RANK", _int(environ, "NODE_RANK", 0)),
        master_addr=environ.get("MASTER_ADDR") or None,
        master_port=_int(environ, "MASTER_PORT"),
        launcher="ray" if environ.get(_RAY_MARK) else "torchrun",
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        # ddpkit run's --rdzv-id as given (torchrun's run id carries the node count too)
        job_id=environ.get("DDPKIT_RUN_ID") or environ.get("TORCHELASTIC_RUN_ID"),
        nodes=_int(environ, "GROUP_WORLD_SIZE"),
        shared_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        vouched=any(environ.get(k) for k in _LAUNCHER_MARKS) or _in_slurm_step(environ),
        join_timeout=_seconds(environ, JOIN_TIMEOUT_VAR),
    )


def _seconds(environ: Mapping[str, str], key: str) -> Optional[float]:
    raw = environ.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"environment variable {key}={raw!r} must be a number of seconds > 0")
    return value


def _in_slurm_step(environ: Mapping[str, str]) -> bool:
    # An interactive salloc shell has SLURM_NTASKS but is not a task of an srun step.
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return False
    return environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def _check_not_batch_shell(environ: Mapping[str, str], world: int) -> None:
    # The batch script has SLURM_PROCID=0 and the job's SLURM_NTASKS, but it is one process:
    # adopting that world would wait for ranks nobody starts (the classic hang).
    if world > 1 and step_id(environ) is None:
        job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "?"
        raise JobSetupError(f"this is the batch script of Slurm job {job}, one process, but "
                            f"the job has {world} tasks: start the script with srun (`srun "
                            "python train.py`, one task per device), or with `srun ddpkit run "
                            "...` (one task per node; `ddpkit slurm` renders that script)")


def _from_slurm(environ: Mapping[str, str]) -> ClusterEnv:
    # A step's own variables first: `srun -n 2 -w node2` inside a bigger allocation runs on a
    # subset of the job's nodes, with its own tasks per node.
    node = _int(environ, "SLURM_NODEID", 0)
    world = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", 1))
    _check_not_batch_shell(environ, world)
    per_node_raw = step_tasks_per_node(environ)
    local_world = world
    if per_node_raw:
        counts = parse_tasks_per_node(per_node_raw)
        local_world = counts[node] if node < len(counts) else counts[-1]
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST"))
    master = environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else None)
    if world > 1 and not master:
        raise ConfigError("Slurm job without SLURM_JOB_NODELIST or MASTER_ADDR: cannot find the "
                          "master; run the script through srun inside an allocation")
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    port = _int(environ, "MASTER_PORT")
    if port is None and job_id:
        port = port_from_job_id(job_id)
    return ClusterEnv(rank=_int(environ, "SLURM_PROCID", 0), world_size=world,
                      local_rank=_int(environ, "SLURM_LOCALID", 0), local_world_size=local_world,
                      node_rank=node, master_addr=master, master_port=port, launcher="slurm",
                      restart_count=_int(environ, "SLURM_RESTART_COUNT", 0), job_id=job_id,
                      nodelist=nodelist,
                      nodes=_int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_NNODES")))


def _from_pod(pod: PodLaunch) -> ClusterEnv:
    # A bare `python train.py` as the pod's command: one process, so one per node.
    if pod.nproc not in (None, "1"):
        raise JobSetupError(f"this pod runs one process, but PET_NPROC_PER_NODE={pod.nproc} "
                            "asks for that many on every node: start the script with `ddpkit "
                            "run train.py` (it reads PET_*), or set numProcPerNode: 1")
    try:
        nodes = int(pod.nnodes or "1")
    except ValueError:
        raise JobSetupError(f"PET_NNODES={pod.nnodes} (a range) needs an elastic launcher: start "
                            "the script with `ddpkit run train.py`") from None
    if nodes > 1 and not pod.endpoint:
        raise ConfigError("the pod sets PET_NNODES but not PET_MASTER_ADDR and PET_MASTER_PORT: "
                          "cannot find the master; render the job with `ddpkit k8s`")
    return ClusterEnv(rank=pod.node_rank or 0, world_size=nodes, node_rank=pod.node_rank or 0,
                      master_addr=pod.master_addr, master_port=pod.master_port,
                      launcher="kubernetes", nodes=nodes)


def detect(environ: Mapping[str, str], argv: Sequence[str] = (),
           expected_world_size: Optional[int] = None) -> ClusterEnv:
    """Detect the launcher from environment variables and return a validated :class:`ClusterEnv`.

    torchrun / ``torch.distributed.launch`` (``RANK`` + ``WORLD_SIZE``) wins over Slurm, because
    ``srun ddpkit run ...`` sets both and torchrun's variables describe the real workers. In a
    Kubernetes pod of Kubeflow Trainer's torch runtime (``PET_*``) a bare process is its node.
    ``expected_world_size`` (for example the number of devices asked for) must match what the
    launcher started, which catches the classic Slurm mistake of one task per node for N GPUs.

    Example::

        import os
        env = detect(os.environ)
        print(env.rank, env.world_size, env.launcher)
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        env = _from_torchrun(environ, argv)
    elif _in_slurm_step(environ):
        env = _from_slurm(environ)
    elif (pod := pod_launch(environ)) is not None and pod.source == "PET_*":
        env = _from_pod(pod)
    else:
        legacy = _legacy_local_rank(argv)
        env = ClusterEnv(local_rank=legacy or 0, local_world_size=(legacy or 0) + 1)
    env.validate()
    if expected_world_size is not None and expected_world_size != env.world_size:
        hint = ("set --ntasks-per-node to the number of devices per node (one task per device)"
                if env.launcher == "slurm" else "launch as many processes as requested")
        raise JobSetupError(f"{env.launcher} started {env.world_size} process(es) but world "
                            f"size {expected_world_size} was requested; {hint}")
    return env


def adopt(env: ClusterEnv, rank: int, world_size: int, hosts: Sequence[str],
          environ: Mapping[str, str]) -> ClusterEnv:
    """``env`` for a process group made before ``ddpkit.setup()`` whose launcher's variables
    say less (Lightning Fabric's launcher sets ``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE``
    but no ``RANK``): the group's rank and size, the nodes counted from ``hosts`` (every rank's
    host name, in rank order).

    Example::

        env = adopt(detect({}), rank=1, world_size=2, hosts=["a", "a"], environ={})
        assert (env.rank, env.local_rank, env.launcher) == (1, 1, "adopted")
    """
    nodes = list(dict.fromkeys(hosts))  # in order of their first rank
    mine = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    local_rank = _int(environ, "LOCAL_RANK")
    return replace(
        env, rank=rank, world_size=world_size,
        local_rank=mine.index(rank) if local_rank is None else local_rank,
        local_world_size=len(mine), node_rank=nodes.index(hosts[rank]), nodes=len(nodes),
        master_addr=env.master_addr or environ.get("MASTER_ADDR") or None,
        master_port=env.master_port or _int(environ, "MASTER_PORT"),
        launcher="adopted", vouched=True).validate()


def spawn_env(rank: int, world_size: int, master_addr: str = "127.0.0.1",
              master_port: Optional[int] = None) -> ClusterEnv:
    """The environment of rank ``rank`` of a single-node job started by ``torch.multiprocessing``.

    Example::

        env = spawn_env(rank=0, world_size=2, master_port=29500)
    """
    env = ClusterEnv(rank=rank, world_size=world_size, local_rank=rank,
                     local_world_size=world_size, master_addr=master_addr,
                     master_port=master_port, launcher="spawn")
    return env.validate()


def to_environ(env: ClusterEnv) -> dict[str, str]:
    """The torchrun-style variables that describe ``env`` (what a child process needs).

    Example::

        os.environ.update(to_environ(spawn_env(0, 2, master_port=29500)))
    """
    out = {"RANK": env.rank, "WORLD_SIZE": env.world_size, "LOCAL_RANK": env.local_rank,
           "LOCAL_WORLD_SIZE": env.local_world_size, "GROUP_RANK": env.node_rank,
           "MASTER_ADDR": env.master_addr, "MASTER_PORT": env.master_port,
           _SPAWNED_VAR: 1 if env.launcher == "spawn" else None}  # vouches for the others
    return {k: str(v) for k, v in out.items() if v is not None}
