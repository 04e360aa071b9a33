"""``ddpkit run``: check the request, then hand over to torchrun's own entry point in-process
(the elastic agent: restarts, rendezvous, signal handling), with one line for each failure.
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import sys
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..faults.crash import LAUNCHER_PID_VAR
from ..base.errors import ConfigError
from ..env.k8s import pod_launch
from ..faults.stops import STOP_SIGNALS, signal_name
from . import (capacity, elastic, forked, network as net, replicas, restarts, srun, stacks,
               watchdog)
from .network import port_in_use

__all__ = ["RunConfig", "run", "torchrun_args", "rendezvous_id", "resolve_nproc", "AGENT_SIGNALS"]

#: The signals torchrun's agent turns into "stop every worker with this signal".
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def resolve_nproc(nproc: str | int, cuda_count: Optional[int] = None) -> int:
    """``auto`` means one process per GPU, or one per CPU core without GPUs; ``gpu`` and
    ``cpu`` (torchrun's, as Kubeflow Trainer may set them) one per GPU, one per core.

    Example::

        resolve_nproc("auto")   # 2 on a 2-core CPU machine
    """
    count = torch.cuda.device_count() if cuda_count is None and str(nproc) in ("auto", "gpu") \
        else cuda_count
    if str(nproc) == "auto":
        return count or (os.cpu_count() or 1)
    if str(nproc) == "cpu":
        return os.cpu_count() or 1
    if str(nproc) == "gpu":
        if not count:
            raise ConfigError("--nproc gpu (PET_NPROC_PER_NODE=gpu) but no CUDA GPU is visible "
                              "here: ask the pod for nvidia.com/gpu, or use auto")
        return count
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
    #: The number of nodes; with ``min_nodes`` the most (``--nnodes MIN:MAX``).
    nnodes: int = 1
    #: Elastic membership (``--nnodes MIN:MAX``): the job goes on while this many remain.
    min_nodes: Optional[int] = None
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    rdzv_timeout: Optional[float] = None
    #: Elastic: once ``min_nodes`` have joined, seconds to wait for more (default 10).
    rdzv_last_call: Optional[float] = None
    #: Whole-group restarts; None: 0, or :data:`ELASTIC_RESTARTS` for an elastic job.
    max_restarts: Optional[int] = None
    module: bool = False
    iface: Optional[str] = None
    log_dir: Optional[str] = None
    verbose: bool = False
    #: After a stop (SIGINT, SIGTERM, SIGUSR1): text appended to the one line printed, e.g.
    #: where the last checkpoint is (``ddpkit train`` sets it).
    on_stop: Optional[Callable[[int], str]] = None
    #: Once the restarts are used up: text appended to the last line, how to continue.
    on_give_up: Optional[Callable[[], str]] = None
    #: How a node's workers start (:mod:`.forked`): ``forkserver``, forked from a server that
    #: imported torch once, or ``spawn``, torchrun's fresh ``python -u SCRIPT`` each.
    start_method: str = "forkserver"
    #: Each process a replica that is restarted alone and heals from a live peer
    #: (:mod:`.replicas`, torchft underneath).
    fault_tolerant: bool = False
    #: ``fault_tolerant``: steps commit while at least this many replicas are alive (None: a
    #: majority of the job's, so that two groups of survivors can never train apart).
    min_replicas: Optional[int] = None
    #: ``fault_tolerant`` on several nodes: ``HOST:PORT`` of the lighthouse (node rank 0's).
    lighthouse: Optional[str] = None

    @property
    def elastic(self) -> bool:
        """Whether membership may change: ``--nnodes MIN:MAX`` with MIN < MAX."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def restarts(self) -> int:
        """The whole-group restarts allowed (``max_restarts``, or its default)."""
        if self.max_restarts is not None:
            return self.max_restarts
        return ELASTIC_RESTARTS if self.elastic else 0

    @property
    def nnodes_spec(self) -> str:
        """``--nnodes`` as given: ``"2"`` or ``"2:3"``."""
        return f"{self.min_nodes}:{self.nnodes}" if self.min_nodes is not None else str(self.nnodes)


#: Restarts an elastic job allows by default: each lost node costs one on every survivor.
ELASTIC_RESTARTS = 10
#: Elastic: seconds to wait for more nodes once MIN have joined (torchrun's own default: 30).
LAST_CALL_S = 10.0
#: With restarts: seconds between a node's rendezvous heartbeats; 3 missed and it is gone
#: (torch: 5).
KEEP_ALIVE_S = 2


def _validate(cfg: RunConfig) -> int:
    nproc = resolve_nproc(cfg.nproc)
    if cfg.nnodes < 1 or (cfg.min_nodes is not None and not 1 <= cfg.min_nodes <= cfg.nnodes):
        raise ConfigError(f"--nnodes {cfg.nnodes_spec}: need 1 <= MIN <= MAX")
    if cfg.elastic and not cfg.rdzv_endpoint:
        raise ConfigError(f"--nnodes {cfg.nnodes_spec} (elastic) needs a c10d rendezvous: "
                          "pass --rdzv-endpoint HOST:PORT (the same on every node; its "
                          "node must stay up), not --master-addr")
    # a task of an srun step: one per node (an elastic range: on any number of them)
    srun.check_layout(None if cfg.elastic else cfg.nnodes, nproc)
    if cfg.rdzv_last_call is not None and cfg.rdzv_last_call <= 0:
        raise ConfigError(f"--rdzv-last-call must be > 0 seconds, got {cfg.rdzv_last_call:g}")
    if cfg.rdzv_last_call is not None and not cfg.elastic:
        raise ConfigError("--rdzv-last-call only applies to an elastic job: give --nnodes "
                          "MIN:MAX, or leave it out")
    if not cfg.elastic and not 0 <= cfg.node_rank < cfg.nnodes:
        raise ConfigError(f"--node-rank {cfg.node_rank} is impossible with --nnodes "
                          f"{cfg.nnodes} (node ranks run from 0 to {cfg.nnodes - 1})")
    if cfg.restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {cfg.max_restarts}")
    if cfg.rdzv_timeout is not None and cfg.rdzv_timeout < 1:
        raise ConfigError(f"--rdzv-timeout must be >= 1 second, got {cfg.rdzv_timeout:g}")
    if not cfg.module:
        _check_script(cfg.script)
    if cfg.nnodes > 1 and not (cfg.rdzv_endpoint or cfg.master_addr):
        raise ConfigError("several nodes need a meeting point: pass --rdzv-endpoint HOST:PORT "
                          "(or --master-addr/--master-port) with the same value on every node")
    if cfg.master_port is not None and cfg.node_rank == 0:
        host = cfg.master_addr or "127.0.0.1"
        if port_in_use(host, cfg.master_port):
            raise ConfigError(f"master port {cfg.master_port} on {host} is already in use; "
                              "choose another --master-port, or omit it to pick a free one")
    capacity.check_memory(nproc)  # this node's workers, before any starts
    warning = capacity.cores_warning(nproc, torch.cuda.device_count())
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return nproc


def _check_script(script: str) -> None:
    """One line, before any process starts, for a script that is missing, a directory, or does
    not compile (every rank would print the same SyntaxError)."""
    if os.path.isdir(script):
        raise ConfigError(f"script {script!r} is a directory; pass the training script inside it "
                          "(a .py file), or -m for a module")
    if not os.path.isfile(script):
        raise ConfigError(f"script {script!r} does not exist (relative to {os.getcwd()})")
    try:
        with open(script, "rb") as f:
            compile(f.read(), script, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ConfigError(f"{script}:{exc.lineno}: SyntaxError: {exc.msg}; fix the script "
                          "before launching it") from None
    except (OSError, ValueError):
        pass  # unreadable here: the ranks will say why


def torchrun_args(cfg: RunConfig, nproc: int, extra: Sequence[str] = ()) -> List[str]:
    """The ``torchrun`` argument list equivalent to ``cfg`` (``extra`` goes before the script).

    Example::

        torchrun_args(RunConfig("t.py", nproc=2), 2)   # ['--nnodes', '1', ...]
    """
    args = ["--nnodes", cfg.nnodes_spec if cfg.elastic else str(cfg.nnodes),
            "--nproc-per-node", str(nproc), "--max-restarts", str(cfg.restarts)]
    if cfg.rdzv_endpoint:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", cfg.rdzv_endpoint,
                 "--rdzv-id", rendezvous_id(cfg)]
    elif cfg.master_addr or cfg.master_port is not None:
        args += ["--node-rank", str(cfg.node_rank),
                 "--master-addr", cfg.master_addr or "127.0.0.1",
                 "--master-port", str(cfg.master_port or 29500)]
    if cfg.log_dir:
        args += ["--log-dir", cfg.log_dir]
    if _agent_takes_signal_list():
        # The agent stops every worker with the signal it got, SIGUSR1 too (Slurm's --signal),
        # so the workers can checkpoint before a preemption (ddpkit.faults.stops).
        args += ["--signals-to-handle", AGENT_SIGNALS]
    args += list(extra)
    if cfg.module:
        args.append("--module")
    return args + [cfg.script, *cfg.script_args]


def rendezvous_id(cfg: RunConfig) -> str:
    """torchrun's run id: ``--rdzv-id`` (default ``ddpkit``) with the node count, so nodes that
    disagree on ``--nnodes`` never form a group together, whoever joins first: each then says
    so in one line (:func:`.watchdog.watch_nnodes`) instead of training until the other leaves.

    Example::

        rendezvous_id(RunConfig("t.py", nnodes=3, min_nodes=2, rdzv_id="job7"))   # 'job7-n2-3'
    """
    return f"{cfg.rdzv_id or 'ddpkit'}-n{cfg.nnodes_spec.replace(':', '-')}"


def _agent_takes_signal_list() -> bool:
    from torch.distributed.run import get_args_parser  # torch >= 2.7 has --signals-to-handle

    return "--signals-to-handle" in get_args_parser()._option_string_actions


def _child_environment(nproc: int, iface: Optional[str]) -> None:
    # Split the cores instead of letting torchrun force one thread per process.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    os.environ.update(net.socket_env(iface))


def _static_checks(cfg: RunConfig) -> None:
    """--master-addr runs: node rank 0 must be the master's machine; others must reach it.

    (Another rank on the master's machine is allowed: several launchers on one host.)"""
    host = cfg.master_addr or "127.0.0.1"
    if ipaddress.ip_address(net.resolve(host)).is_loopback:
        return  # every "node" on this one machine
    hosting = net.is_local(host)
    if cfg.node_rank == 0 and not hosting:
        raise ConfigError(f"--node-rank 0 must run on the --master-addr host {host}, which is "
                          "not an address of this node: give this node another --node-rank")
    if not hosting:
        net.check_reachable(host, cfg.master_port or 29500)


def _network(cfg: RunConfig) -> Tuple[List[str], net.NodeNetwork]:
    """Several nodes: check the meeting point and pick the interface; extra torchrun flags.

    c10d (``--rdzv-endpoint``): who serves the store, the address to publish, the interface
    that routes to the endpoint, a fresh store per rendezvous round. Static (``--master-addr``):
    the ``--node-rank 0`` / reachability checks and the join timeout."""
    given = net.NodeNetwork(cfg.iface, None, is_host=False)
    if cfg.nnodes <= 1 and not cfg.elastic:
        return [], given
    if not cfg.rdzv_endpoint:
        _static_checks(cfg)
        return (["--rdzv-conf", f"timeout={int(cfg.rdzv_timeout)}"] if cfg.rdzv_timeout
                else []), given
    if pod_launch(os.environ) is not None:  # a pod: the endpoint's pod may start later
        net.wait_resolvable(net.split_endpoint(cfg.rdzv_endpoint)[0], cfg.rdzv_timeout or 600.0,
                            lambda line: print(line, file=sys.stderr, flush=True))
    plan = net.node_network(cfg.rdzv_endpoint, cfg.iface)
    # A fresh store per rendezvous round (served by worker rank 0): no stale keys after a
    # restart, whatever each node's restart count (see ddpkit.env.dist).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    conf: dict = {}
    if cfg.elastic or cfg.restarts:
        # a node that is gone (an eviction, a crash) is dropped from the rendezvous after 3
        # missed heartbeats: the next round does not wait torch's 3 x 5 s for it
        conf = {"keep_alive_interval": KEEP_ALIVE_S, "keep_alive_max_attempt": 3}
    if cfg.elastic:  # a shrunk job waits a moment for more nodes
        conf["last_call_timeout"] = int(max(1, round(cfg.rdzv_last_call or LAST_CALL_S)))
    return net.torchrun_extra_args(plan, cfg.rdzv_timeout, conf), plan


def _guard(cfg: RunConfig, is_host: bool) -> Any:
    """Several nodes meeting at a c10d endpoint: the --nnodes check, the agent watchdog and the
    answers for a stopped worker's stack."""
    if (cfg.nnodes <= 1 and not cfg.elastic) or not cfg.rdzv_endpoint:
        return contextlib.nullcontext()
    watchdog.watch_nnodes(cfg.rdzv_endpoint, cfg.nnodes_spec, cfg.rdzv_id or "ddpkit",
                          cfg.rdzv_timeout or 600.0, is_host=is_host)
    guards = contextlib.ExitStack()
    guards.enter_context(watchdog.AgentWatchdog(cfg.rdzv_endpoint))
    guards.enter_context(stacks.StackAnswers())  # a stopped worker alone on this node
    return guards


def run(cfg: RunConfig) -> int:
    """Launch ``cfg.script`` on ``nproc`` processes per node through torchrun; returns the exit code.

    On several nodes (:mod:`.network`, :mod:`.watchdog`): the endpoint is checked first, the node that holds its
    address serves the store, gloo/NCCL use the interface that routes there (or ``iface``), a
    node with another ``--nnodes`` and an agent cut off from the store stop with one line, and
    rendezvous failures raise a one-line :class:`ConfigError`. Workers that call
    ``ddpkit.setup()`` die with this process.

    Example::

        code = run(RunConfig("train.py", ["--epochs", "1"], nproc=2))
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser

    if cfg.fault_tolerant:  # each process a replica: restarted alone (torchft underneath)
        if not cfg.module:
            _check_script(cfg.script)
        return replicas.run(cfg, resolve_nproc(cfg.nproc))
    nproc = _validate(cfg)
    if cfg.nnodes <= 1 and not (cfg.elastic or cfg.rdzv_endpoint or cfg.master_addr
                                or cfg.master_port is not None):
        # torchrun's default store port, 29500, would collide with another job on this machine
        cfg = dataclasses.replace(cfg, master_port=net.free_port())
    extra, plan = _network(cfg)
    _child_environment(nproc, plan.iface)
    previous_endpoint = os.environ.pop(RDZV_ENDPOINT_VAR, None)  # not an outer job's
    previous_id = os.environ.pop(RUN_ID_VAR, None)
    if cfg.rdzv_endpoint:  # the workers know their job's rendezvous (ddpkit doctor's ports)
        os.environ[RDZV_ENDPOINT_VAR] = cfg.rdzv_endpoint
        os.environ[RUN_ID_VAR] = cfg.rdzv_id or "ddpkit"  # as given (torchrun's has the count)
    if not cfg.verbose:
        _quiet_agent_logs()
    previous_pid = os.environ.get(LAUNCHER_PID_VAR)
    os.environ[LAUNCHER_PID_VAR] = str(os.getpid())  # workers die with this process
    # forked workers: their server first (importing torch while the rendezvous forms), known
    # before the agent starts, so that a stop ends its workers, not the server itself
    server = forked.start_server() if cfg.start_method == "forkserver" else None
    members, before = None, set(watchdog.children())
    try:
        tracking = (elastic.tracking_members(cfg.nnodes_spec, plan.local_addr) if cfg.elastic
                    else contextlib.nullcontext())
        stranded = elastic.counting_stranded_nodes() if cfg.elastic else contextlib.nullcontext()
        own = cfg.module and cfg.script.startswith("ddpkit.")  # ddpkit's own workers
        with _guard(cfg, plan.is_host), restarts.naming_restarts() as said, tracking as members, \
                stranded, watchdog.ending_stopped_workers(), \
                watchdog.holding_early_interrupts(own):
            _agent(_parse(get_args_parser(), torchrun_args(cfg, nproc, extra)), cfg.start_method)
    except SignalException as exc:  # the agent stopped every worker with this signal first
        watchdog.stop_lost_workers(before, servers=[server])  # those it was starting then
        return _stopped(cfg, int(exc.sigval))
    except KeyboardInterrupt:  # Ctrl-C before the agent's own handlers were in place
        watchdog.stop_lost_workers(before, servers=[server])
        return _stopped(cfg, signal.SIGINT)
    except ChildFailedError as exc:
        stopped = _stop_signal(exc)
        if stopped is not None:  # the workers themselves were told to stop (Slurm, kill)
            return _stopped(cfg, stopped)
        rank, failure = _root_cause(exc)
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        if not restarts.said_in_one_line(failure):  # else its `error:` line says it all
            what = said["left_early"] or f"rank {rank} failed ({restarts.how(failure)})"
            print(f"ddpkit run: {what}{restarts.used_up(cfg.restarts, cfg.on_give_up)}",
                  flush=True, file=sys.stderr)
        return code
    except Exception as exc:
        if cfg.nnodes <= 1:
            raise
        endpoint = cfg.rdzv_endpoint or f"{cfg.master_addr}:{cfg.master_port or 29500}"
        failure = net.rendezvous_failure(exc, endpoint, cfg.min_nodes or cfg.nnodes,
                                         cfg.rdzv_timeout)
        if failure is None:
            raise
        if cfg.elastic and type(exc).__name__ == "RendezvousTimeoutError" and \
                getattr(members, "last", None):
            failure = ConfigError(f"the rendezvous at {endpoint} did not gather "
                                  f"{cfg.min_nodes} nodes within {cfg.rdzv_timeout or 600:.0f} s; "
                                  + elastic.missing_line(members.last, members.me,
                                                         cfg.nnodes_spec))
        raise failure from None
    finally:
        for var, previous in ((LAUNCHER_PID_VAR, previous_pid),
                              (RDZV_ENDPOINT_VAR, previous_endpoint), (RUN_ID_VAR, previous_id)):
            if previous is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = previous
    return 0


#: The rendezvous endpoint of the job a worker belongs to, as ``ddpkit run`` was given it.
RDZV_ENDPOINT_VAR = "DDPKIT_RDZV_ENDPOINT"
#: The job's ``--rdzv-id`` as given (torchrun's run id also carries the node count).
RUN_ID_VAR = "DDPKIT_RUN_ID"


def _agent(args: Any, start_method: str) -> None:
    """torchrun's own ``run(args)``; with ``forkserver`` its workers run :func:`.forked.python`
    on the arguments it would have given ``python`` (``-u [-m] SCRIPT ARGS``)."""
    from torch.distributed import run as torchrun

    if start_method != "forkserver" or args.no_python or args.run_path:
        torchrun.run(args)
        return
    config_from_args = torchrun.config_from_args

    def forked_config(parsed: Any) -> Any:
        config, _python, cmd_args = config_from_args(parsed)
        config.start_method = "forkserver"
        return config, forked.python, cmd_args

    torchrun.config_from_args = forked_config  # (run() started the server)
    try:
        torchrun.run(args)
    finally:
        torchrun.config_from_args = config_from_args


def _parse(parser: Any, argv: List[str]) -> Any:
    # No abbreviations: argparse would otherwise read the script's own --signal as an ambiguous
    # abbreviation of torchrun's --signals-to-handle and stop with torchrun's usage.
    parser.allow_abbrev = False
    return parser.parse_args(argv)


def _quiet_agent_logs() -> None:
    # The agent's loggers are created on import with their own levels: quiet each of them.
    # (torch.multiprocessing: "Terminating process N via signal SIGTERM" of forked workers)
    for name in list(logging.root.manager.loggerDict) + ["torch.multiprocessing.spawn"]:
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _stop_signal(exc: Any) -> Optional[int]:
    """The stop signal every failed worker exited for (status 128 + it), or None."""
    codes = {f.exitcode for f in exc.failures.values()}
    signums = {code - 128 if code > 128 else -code for code in codes}
    return signums.pop() if len(signums) == 1 and signums <= set(STOP_SIGNALS) else None


def _stopped(cfg: RunConfig, signum: int) -> int:
    """One line for a stop the user or the cluster asked for; the status 128 + the signal."""
    what = ("interrupted (SIGINT)" if signum == signal.SIGINT
            else f"stopped by {signal_name(signum)}")
    extra = cfg.on_stop(signum) if cfg.on_stop is not None else ""
    print(f"ddpkit run: {what}; every worker stopped{extra}", file=sys.stderr, flush=True)
    return 128 + signum


def _root_cause(exc: Any) -> Any:
    """The failure that started it, as (rank, failure): see :func:`.restarts.first_failure`."""
    return restarts.first_failure(exc.failures)
