"""``ddpkit run --fault-tolerant``: each process a replica of the model (torchft underneath). A
replica that dies is restarted alone and takes a live peer's state; the others never stop.

One launcher a node, as without the flag; there is no rendezvous: torchft's lighthouse (started
in-process by node rank 0, or on one node by this launcher) keeps the quorum of each step. The
launcher starts, watches and restarts its node's replicas (forked from one server that imported
torch once, or spawned), forwards a stop signal to them, and says each event in one line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from ..base.errors import ConfigError
from ..engines.live import (JOINED_VAR, LIGHTHOUSE_VAR, LIVE_VAR, MIN_REPLICAS_VAR,
                            REPLICA_INDEX_VAR, REPLICA_VAR, REPLICAS_HERE_VAR,
                            torchft_missing)
from ..faults.crash import LAUNCHER_PID_VAR
from ..faults.stops import STOP_SIGNALS, signal_name
from . import forked, network as net

__all__ = ["run", "RESTARTS", "HEARTBEAT_TIMEOUT_MS", "JOIN_TIMEOUT_MS"]

#: Restarts of one replica (``--max-restarts`` overrides): one that keeps dying is given up.
RESTARTS = 10
#: A replica whose heartbeats stop this long is out of the quorum (torchft: 5 s).
HEARTBEAT_TIMEOUT_MS = 1000
#: Once enough replicas asked for a quorum, how long to wait for the others (torchft: 60 s).
JOIN_TIMEOUT_MS = 1000
_POLL_S = 0.05
#: Seconds a node waits for the lighthouse on node rank 0 (``--rdzv-timeout`` overrides).
LIGHTHOUSE_WAIT_S = 300.0
#: A replica stopped (SIGSTOP, a debugger) this long is said once.
STOPPED_SAY_S = 3.0


def _say(line: str) -> None:
    os.write(2, f"ddpkit run: {line}\n".encode())


def _node_rank_from_slurm(cfg: Any, environ: Any) -> Any:
    """In a task of an srun step (one a node), the node's rank is Slurm's ``SLURM_NODEID``:
    the first node of the allocation, rank 0, runs the lighthouse."""
    import dataclasses

    if cfg.nnodes > 1 and cfg.node_rank == 0 and "SLURM_STEP_ID" in environ and \
            "SLURM_NODEID" in environ:
        return dataclasses.replace(cfg, node_rank=int(environ["SLURM_NODEID"]))
    return cfg


def start_lighthouse(cfg: Any) -> Tuple[Optional[Any], str]:
    """The lighthouse this node's replicas report to: ``(server or None, http address)``; node
    rank 0 (or a single node) runs it in this process."""
    from torchft.coordination import LighthouseServer

    if cfg.lighthouse:
        host, port = net.split_endpoint(cfg.lighthouse, 29510)
        address = f"http://{host}:{port}"
        if cfg.node_rank != 0:
            wait_for_lighthouse(host, port, cfg.rdzv_timeout or LIGHTHOUSE_WAIT_S)
            return None, address
        bind = f"[::]:{port}"
    elif cfg.nnodes > 1:
        raise ConfigError("--fault-tolerant on several nodes needs --lighthouse HOST:PORT, the "
                          "same on every node (node rank 0 starts it there)")
    else:
        port = net.free_port()
        address, bind = f"http://127.0.0.1:{port}", f"[::]:{port}"
    try:
        server = LighthouseServer(bind=bind, min_replicas=cfg.min_replicas,
                                  join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    except Exception as exc:
        raise ConfigError(f"could not start the lighthouse on {bind} "
                          f"({str(exc).splitlines()[0][:120]}): is the port free?") from None
    return server, address


def wait_for_lighthouse(host: str, port: int, timeout: float) -> None:
    """Until the lighthouse accepts a connection (node rank 0 may start later); one line past
    ``timeout`` seconds (``--rdzv-timeout``)."""
    start, why = time.monotonic(), "?"
    while time.monotonic() - start < timeout:
        try:
            with socket.create_connection((net.resolve(host), port), timeout=2.0):
                return
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
        time.sleep(0.5)
    raise ConfigError(f"the lighthouse {host}:{port} is not reachable from this node ({why}; "
                      f"tried for {time.monotonic() - start:.0f} s): start node rank 0 (it "
                      "runs the lighthouse), or check --lighthouse")


def _advertised(cfg: Any) -> str:
    """The address peers reach this node's replicas at (their heal transfers)."""
    if not cfg.lighthouse:
        return "127.0.0.1"
    host = net.split_endpoint(cfg.lighthouse, 29510)[0]
    route = net.route_to(host)
    return route.src if route is not None and route.src else "127.0.0.1"


class Replica:
    """One local replica: its process, its name, its restarts."""

    def __init__(self, cfg: Any, local_rank: int, nproc: int, env: Dict[str, str]) -> None:
        self.cfg, self.local_rank = cfg, local_rank
        self.name = f"node{cfg.node_rank}-{local_rank}"
        # a job of one process to everything but torchft: its own device, if there are GPUs
        self.env = {**env, REPLICA_VAR: self.name, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    REPLICA_INDEX_VAR: str(cfg.node_rank * nproc + local_rank),
                    REPLICAS_HERE_VAR: str(nproc),
                    **_device(local_rank, env)}
        self.restarts, self.process, self.done = 0, None, False
        self.started_at = 0.0
        self.joined_file = os.path.join(cfg_dir(), self.name)
        self.env[JOINED_VAR] = self.joined_file
        self.failed_starting = 0  # failures in a row before joining a quorum
        self.raised = 0           # failures in a row by an error (exit code > 0)
        self.stopped_since: Optional[float] = None
        self.said_stopped = False

    @property
    def joined(self) -> bool:
        """Whether the process running now joined a quorum (it started well)."""
        return os.path.exists(self.joined_file)

    def start(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.joined_file)
        env = {**self.env, "TORCHELASTIC_RESTART_COUNT": str(self.restarts),
               "MASTER_PORT": str(net.free_port())}
        argv = (["-m"] if self.cfg.module else []) + [self.cfg.script, *self.cfg.script_args]
        if self.cfg.start_method == "forkserver":
            self.process = forked.Forked(argv, env, capture=False)
        else:
            self.process = subprocess.Popen([sys.executable, "-u", *argv], env=env,
                                            start_new_session=True)
        self.started_at = time.monotonic()

    def poll(self) -> Optional[int]:
        if self.process is None:
            return None
        code = self.process.returncode if isinstance(self.process, forked.Forked) \
            else self.process.poll()
        return code

    def watch_stopped(self) -> None:
        """Say once when the replica has been stopped (SIGSTOP, a debugger) a while: the others
        left it behind at their next step; continued, it heals and goes on."""
        pid = getattr(self.process, "pid", None)
        stopped = pid is not None and _state(pid) in ("T", "t")
        if not stopped:
            self.stopped_since, self.said_stopped = None, False
            return
        now = time.monotonic()
        self.stopped_since = self.stopped_since or now
        if not self.said_stopped and now - self.stopped_since >= STOPPED_SAY_S:
            self.said_stopped = True
            _say(f"replica {self.name} has been stopped for {now - self.stopped_since:.0f} s "
                 f"(pid {pid}, state T): the others go on without it; continued (kill -CONT "
                 f"{pid}) it takes a live peer's state, or kill it to have it restarted")

    def signal(self, signum: int) -> None:
        pid = getattr(self.process, "pid", None)
        if pid is not None and self.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signum)


def _device(local_rank: int, env: Dict[str, str]) -> Dict[str, str]:
    """The GPU of the ``local_rank``-th replica (each sees one, as device 0), if any."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": ids[local_rank % len(ids)]} if ids else {}


#: A replica's exit code for bad input (a one-line ConfigError): restarting cannot help.
_BAD_INPUT = 2


def _state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T ...), '' if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


@contextlib.contextmanager
def _env(name: str, value: str) -> Any:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _how(code: int) -> str:
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"


_DIR: List[str] = []


def cfg_dir() -> str:
    """This launcher's scratch directory (the replicas' "joined" files), removed at its end."""
    if not _DIR:
        import atexit
        import shutil
        import tempfile

        _DIR.append(tempfile.mkdtemp(prefix="ddpkit-replicas-"))
        atexit.register(shutil.rmtree, _DIR[0], True)
    return _DIR[0]


def _environment(cfg: Any, address: str) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({LIVE_VAR: "1", LIGHTHOUSE_VAR: address, MIN_REPLICAS_VAR: str(cfg.min_replicas),
                "RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                LAUNCHER_PID_VAR: str(os.getpid()), "DDPKIT_REPLICA_HOST": _advertised(cfg),
                "TORCHFT_QUORUM_RETRIES": env.get("TORCHFT_QUORUM_RETRIES", "3")})
    # torchft's Rust side logs every quorum at INFO, and c10d warns each time a peer's socket
    # closes or a store's client cannot name its host: replicas come and go here by design
    env.setdefault("RUST_LOG", "error")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def run(cfg: Any, nproc: int) -> int:
    """Start ``nproc`` replicas of ``cfg.script`` on this node and keep them alive; the exit
    code: 0 once the training ran to its end, else the last failure's.

    Example::

        code = run(RunConfig("train.py", nproc=3, fault_tolerant=True), 3)
    """
    os.environ.setdefault("RUST_LOG", "error")  # the lighthouse's logs, read at torchft's import
    missing = torchft_missing()
    if missing:
        raise ConfigError(missing)
    if cfg.min_replicas is None:  # a majority: two groups can never both go on (split brain)
        cfg = dataclasses.replace(cfg, min_replicas=cfg.nnodes * nproc // 2 + 1)
    if cfg.min_replicas < 1:
        raise ConfigError(f"--min-replicas must be >= 1, got {cfg.min_replicas}")
    if cfg.nnodes <= 1 and cfg.min_replicas > nproc:
        raise ConfigError(f"--min-replicas {cfg.min_replicas} can never be met: this node runs "
                          f"{nproc} replica(s) (--nproc {nproc}); ask for fewer or run more")
    restarts = cfg.max_restarts if cfg.max_restarts is not None else RESTARTS
    cfg = _node_rank_from_slurm(cfg, os.environ)
    server, address = start_lighthouse(cfg)
    env = _environment(cfg, address)
    if cfg.start_method == "forkserver":
        # the server reads it as it imports torch (the workers' C++ log level is its own)
        with _env("TORCH_CPP_LOG_LEVEL", os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")):
            forked.start_server()
    replicas = [Replica(cfg, i, nproc, env) for i in range(nproc)]
    stopped: List[int] = []
    handlers = {s: signal.signal(s, lambda signum, _f: stopped.append(signum))
                for s in STOP_SIGNALS}
    try:
        for r in replicas:
            r.start()
        return _watch(replicas, restarts, stopped)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        for r in replicas:
            r.signal(signal.SIGKILL)
        if server is not None:
            server.shutdown()


def _watch(replicas: List[Replica], restarts: int, stopped: List[int]) -> int:
    failed: Optional[int] = None
    while not all(r.done for r in replicas):
        if stopped:
            return _stop(replicas, stopped[0])
        for r in replicas:
            code = None if r.done else r.poll()
            if code is None:
                r.watch_stopped()
                continue
            if code == 0:
                r.done = True
                _finishing(replicas)
            elif any(o.done and o.poll() == 0 for o in replicas):  # the training is over
                r.done = True
            elif code == _BAD_INPUT:  # its error line said why; the others would say the same
                for other in replicas:
                    other.signal(signal.SIGKILL)
                return code
            elif (not r.joined and r.failed_starting >= 1) or (code > 0 and r.raised >= 1):
                # the script itself fails (twice in a row): a restart would fail again
                for other in replicas:
                    other.signal(signal.SIGKILL)
                when = "before joining the job" if not r.joined else "in a row"
                _say(f"replica {r.name} failed twice {when} ({_how(code)}; its error is "
                     "above): stopping every replica")
                return code if code > 0 else 1
            elif r.restarts < restarts:
                r.failed_starting = 0 if r.joined else r.failed_starting + 1
                r.raised = r.raised + 1 if code > 0 else 0  # an error, not a lost process
                r.restarts += 1
                _say(f"replica {r.name} failed ({_how(code)}); restarting it alone (restart "
                     f"{r.restarts} of {restarts}): it takes a live peer's state, the others "
                     "go on")
                r.start()
            else:
                r.done, failed = True, code if code > 0 else 1
                _say(f"replica {r.name} failed ({_how(code)}) after {restarts} restart(s); "
                     "given up: the others go on without it (--max-restarts to allow more)")
        time.sleep(_POLL_S)
    finished = sum(1 for r in replicas if r.poll() == 0)
    return 0 if finished else (failed or 1)


def _finishing(replicas: List[Replica]) -> None:
    """A replica ran the training to its end: one still starting (not yet in a quorum) would
    find nobody to heal from and train again alone; it is stopped, not restarted."""
    for r in replicas:
        if r.done or r.poll() is not None:
            continue
        if not r.joined:
            why = "was starting"
        elif r.stopped_since is not None:
            why = "was stopped (state T)"
        else:
            continue  # in the quorum: it ends with the others
        r.signal(signal.SIGKILL)
        r.done = True
        _say(f"replica {r.name} {why} when the training ended: ended")


def _stop(replicas: List[Replica], signum: int) -> int:
    """Every replica gets the stop (it saves if its checkpointer is due, then exits)."""
    for r in replicas:
        r.signal(signum)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and any(r.poll() is None for r in replicas):
        time.sleep(_POLL_S)
    _say(f"stopped by {signal_name(signum)}")
    return 128 + signum
