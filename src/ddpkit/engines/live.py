"""The ``live`` engine (``ddpkit run --fault-tolerant``): every replica a process group of its
own, the gradient averaged over the replicas alive at each step through torchft's Manager, a
step committed only where every one of them finished it, a lost replica healed from a live one.

torchft (``pip install 'ddpkit[ft]'``) keeps the quorum (its lighthouse), reconfigures the
replicas' gloo/NCCL group and moves a peer's state to a replica that joins; ddpkit decides what a
step's data is (:mod:`ddpkit.data.live`) and what a replica's state is (the checkpointer's).
To everything else a replica is a job of one process: its collectives answer for one, and
``rt.evaluate`` evaluates every sample on each replica (exact, and no failure can split it).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import socket
import warnings
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from ..base.errors import ConfigError
from ..base.wrap import WrapOptions
from ..env.detect import ClusterEnv
from .torchdist import TorchEngine

__all__ = ["LiveEngine", "Live", "LIVE_VAR", "LIGHTHOUSE_VAR", "REPLICA_VAR", "MIN_REPLICAS_VAR",
           "current"]

#: Set by ``ddpkit run --fault-tolerant`` in each worker: "1".
LIVE_VAR = "DDPKIT_FAULT_TOLERANT"
#: The lighthouse's address (``http://host:port``).
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
#: This replica's name among the job's (node and local rank).
REPLICA_VAR = "DDPKIT_REPLICA_ID"
#: This replica's number among the job's at start (node rank x processes a node + local).
REPLICA_INDEX_VAR = "DDPKIT_REPLICA_INDEX"
#: A file the replica creates once it joined its first quorum (the launcher reads it).
JOINED_VAR = "DDPKIT_REPLICA_JOINED"
#: How many replicas this node runs (they share its CPU cores).
REPLICAS_HERE_VAR = "DDPKIT_REPLICAS_HERE"
#: A directory where each replica writes the samples of every step it committed (an audit).
LEDGER_VAR = "DDPKIT_LIVE_LEDGER"
#: The fewest replicas a step commits with.
MIN_REPLICAS_VAR = "DDPKIT_MIN_REPLICAS"
#: Seconds a quorum (or a heal) may take before the replica gives up with one line.
QUORUM_TIMEOUT_VAR = "DDPKIT_QUORUM_TIMEOUT"

_CURRENT: Optional["Live"] = None


def current() -> Optional["Live"]:
    """This process's :class:`Live`, when it is a replica of a fault-tolerant run."""
    return _CURRENT


def replica_name() -> str:
    """This replica's name (``node-localrank``), as the launcher gave it."""
    return os.environ.get(REPLICA_VAR) or socket.gethostname()


def say(line: str) -> None:
    """One whole line on standard error from this replica, whether or not it leads."""
    os.write(2, f"ddpkit: {line}\n".encode())


def torchft_missing() -> Optional[str]:
    """One line when torchft cannot be imported, else None."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return (f"--fault-tolerant needs torchft ({exc}): pip install 'ddpkit[ft]'")
    return None


class Live:
    """This replica's place among the live ones, step by step: the quorum of the step
    (``rank`` of ``replicas``), the committed step count (``step``: the data's position),
    the weight of its gradient (its samples over the step's), and whether the last step
    committed. Made by :class:`LiveEngine`; the loader and the checkpointer use it.

    Example::

        live = ddpkit.engines.live.current()
        rank, replicas = live.begin_step()   # the quorum of this step (a heal happens here)
    """

    def __init__(self, manager: Any, seed: int = 0) -> None:
        # the Manager (or what makes it): made when first needed, by the checkpointer right
        # before the first quorum: from then on it heartbeats, and the lighthouse waits for a
        # replica that heartbeats (up to its join timeout, at every step of the others)
        self._manager = None if callable(manager) and not hasattr(manager, "current_step") \
            else manager
        self._make = manager if self._manager is None else None
        self._pending_step = 0
        self.seed = seed
        # before the first quorum: the launcher's numbering (the first replica prints)
        self.rank = int(os.environ.get(REPLICA_INDEX_VAR, "0"))
        self.replicas = 1
        self.weight = 1.0
        self.committed = True      # the last step's commit
        self.quorums = 0           # quorums begun
        self.heals = 0             # times this replica took a live peer's state
        self._reused = False       # a quorum begun by the checkpointer, kept for the first step
        self._said_replicas = 0    # the replicas of the last committed step said
        self.attached = False      # a checkpointer holds this replica's state
        #: called as each step begins, and when a step does not commit (undo what it did)
        self.at_begin: List[Callable[[], None]] = []
        self.at_rollback: List[Callable[[], None]] = []
        #: the samples this replica counted in the step under way (the loader sets them)
        self.share: List[int] = []
        self._ledger = _open_ledger()

    @property
    def manager(self) -> Any:
        """torchft's Manager of this replica (made at the first use)."""
        if self._manager is None:
            self._manager = self._make()
            self._manager.load_state_dict({"step": self._pending_step, "batches_committed": 0})
        return self._manager

    @property
    def step(self) -> int:
        """Steps committed by the job (equal on every replica of a quorum)."""
        if self._manager is None:
            return self._pending_step
        return int(self._manager.current_step())

    @step.setter
    def step(self, value: int) -> None:
        if self._manager is None:
            self._pending_step = int(value)
            return
        self._manager.load_state_dict({"step": int(value),
                                       "batches_committed": self._manager.batches_committed()})

    def shutdown(self) -> None:
        """Leave: the Manager's servers stop (the others see this replica gone)."""
        if self._manager is not None:
            with contextlib.suppress(Exception):
                self._manager.shutdown(wait=False)

    def begin_step(self) -> Tuple[int, int]:
        """Join the step's quorum (taking a live peer's state first if this replica is behind:
        a heal) and seed this step's random draws; this replica's rank and the replicas."""
        if not self.attached:
            raise ConfigError("a fault-tolerant run needs rt.checkpointer(directory or None, "
                              "model=, optimizer=, loader=) before its loop: a replica that "
                              "joins takes what it holds from a live peer")
        if self._reused:
            self._reused = False
        else:
            self._quorum()
        self.rank = int(self.manager.participating_rank() or 0)
        self.replicas = max(int(self.manager.num_participants()), 1)
        # dropout and the like: a function of (seed, step, share), whoever computes the share
        s = (self.seed * 1_000_003 + self.step * 7_919 + self.rank * 104_729
             + self.replicas * 31) % (2 ** 63)
        torch.manual_seed(s)
        random.seed(s)
        for begin in self.at_begin:
            begin()
        return self.rank, self.replicas

    def join(self) -> None:
        """The first quorum, before the loop: a replica that joins a running job takes a live
        peer's state here (the checkpointer calls it), so its loop starts where the job is."""
        self._quorum()
        self._reused = True
        joined = os.environ.get(JOINED_VAR)
        if joined:  # the launcher: from now on a failure is a lost replica, not a bad start
            with contextlib.suppress(OSError), open(joined, "w"):
                pass

    def _quorum(self) -> None:
        before = self.step
        try:
            self.manager.start_quorum()
        except Exception as exc:  # the lighthouse gone, too few replicas for too long
            raise ConfigError(_quorum_failure(exc)) from None
        self.quorums += 1
        if self.step != before:
            self.heals += 1

    def record_share(self, indices: List[int]) -> None:
        """The samples this replica counts in the step under way; with ``DDPKIT_LIVE_LEDGER``
        written before its gradient can reach the others (a share in a step the quorum
        committed was trained, whatever became of the replica after its all-reduce)."""
        self.share = list(indices)
        if self._ledger is not None:
            self._ledger.write(json.dumps({"step": self.step, "idx": self.share, "quorum":
                                           getattr(self.manager, "_quorum_id", None)}) + "\n")

    def counted(self, samples: int, global_samples: int) -> None:
        """The step's batch has ``global_samples``, this replica computes ``samples`` of them."""
        self.weight = samples / max(global_samples, 1)

    def commit(self) -> bool:
        """Whether every replica of the quorum finished the step (then the optimizer steps)."""
        quorum = getattr(self.manager, "_quorum_id", None)
        self.committed = bool(self.manager.should_commit())
        if not self.committed:
            for undo in self.at_rollback:
                undo()
        if self.committed and self._ledger is not None:
            self._ledger.write(json.dumps({"step": self.step - 1, "quorum": quorum,
                                           "committed": True}) + "\n")
        if self.committed and self.replicas != self._said_replicas:
            if self._said_replicas and self.leads():  # the first quorum is no news
                say(f"step {self.step - 1} committed by {self.replicas} replica(s) "
                    f"({self._said_replicas} before)")
            self._said_replicas = self.replicas
        return self.committed

    def leads(self) -> bool:
        """Whether this replica writes checkpoints and prints for the job now (its quorum's
        first)."""
        return self.rank == 0



class LiveModel(nn.Module):
    """The model of a fault-tolerant replica: after each backward pass (unless in
    :meth:`no_sync`) its gradients, weighted by this replica's share of the step's samples, are
    summed over the step's quorum in one all-reduce: the mean gradient of the step's batch,
    whoever computed which part. Not DDP: DDP rebuilds its buckets after the first step, and a
    replica that joins later would reduce other buckets than its peers.

    Example::

        model = LiveModel(Net(), live)
        loss = model(x).sum(); loss.backward()   # gradients summed over the live replicas
    """

    wraps_module = True  # ddpkit.base.wrap.unwrap: the user's module is .module

    def __init__(self, module: nn.Module, live: Live) -> None:
        super().__init__()
        self.module, self._live = module, live
        self._sync, self._queued = True, False
        self._params = [p for p in module.parameters() if p.requires_grad]
        # running statistics (BatchNorm's): each replica's from its share; averaged with the
        # same weights they are the step's batch's, and the same on every replica after a step
        self._buffers = [b for b in module.buffers() if b.is_floating_point()]
        self._saved: List[torch.Tensor] = []
        if self._buffers:  # a step that does not commit leaves them as they were before it
            live.at_begin.append(self._save_buffers)
            live.at_rollback.append(self._restore_buffers)
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _save_buffers(self) -> None:
        self._saved = [b.detach().clone() for b in self._buffers]

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for b, saved in zip(self._buffers, self._saved):
                b.copy_(saved)

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        """Accumulate this micro-batch's gradients without reducing them (as DDP's)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _ready(self, _param: torch.Tensor) -> None:
        if self._sync and not self._queued:  # once the whole backward pass is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self) -> None:
        from torch.distributed import ReduceOp

        self._queued = False
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        tensors = grads + [b.detach() for b in self._buffers]
        flat = torch._utils._flatten_dense_tensors(tensors).mul_(self._live.weight)
        self._live.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        reduced = torch._utils._unflatten_dense_tensors(flat, tensors)
        for p, value in zip(self._params, reduced):
            if p.grad is not None:
                p.grad.copy_(value)
            elif value.any():  # the others had a gradient for it
                p.grad = value.clone()
        with torch.no_grad():
            for b, value in zip(self._buffers, reduced[len(grads):]):
                b.copy_(value)


def _open_ledger() -> Optional[Any]:
    """``DDPKIT_LIVE_LEDGER=DIR``: each replica appends, for every step, the samples it counted
    and its quorum (before the vote) and then whether the step committed, one JSON line each
    (``ledger-REPLICA-ATTEMPT.jsonl``): a step committed by any replica of a quorum trained
    every share of that quorum, so each sample of an epoch can be counted once."""
    directory = os.environ.get(LEDGER_VAR)
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    name = f"ledger-{replica_name()}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.jsonl"
    return open(os.path.join(directory, name), "a", buffering=1)


def _quorum_failure(exc: BaseException) -> str:
    lighthouse = os.environ.get(LIGHTHOUSE_VAR, "?")
    wanted = os.environ.get(MIN_REPLICAS_VAR, "1")
    return (f"no quorum of at least {wanted} replica(s) at the lighthouse {lighthouse} within "
            f"{os.environ.get(QUORUM_TIMEOUT_VAR, '60')} s ({str(exc).splitlines()[0][:160]}): "
            "is the node that hosts it up, and are enough replicas running?")


def _transport(timeout: timedelta) -> Any:
    """torchft's HTTP transport of a peer's state, at the address the launcher advertises (the
    host name may not reach this node: in network namespaces every node has the same one)."""
    from torchft.checkpointing import HTTPTransport

    host = os.environ.get("DDPKIT_REPLICA_HOST")

    class Transport(HTTPTransport):
        def address(self) -> str:
            if not host:
                return super().address()
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    transport = Transport(timeout=timeout, num_chunks=0)
    # its HTTP server logs every request a healing peer makes on standard error
    transport._server.RequestHandlerClass.log_message = lambda *args: None
    return transport


def _manager(step_s: float, quorum_s: float) -> Any:
    """torchft's Manager of this replica (a group of one), reporting to the lighthouse."""
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    # peers meet in the quorum's first replica's store: at the address they reach it on
    host = os.environ.get("DDPKIT_REPLICA_HOST") or "127.0.0.1"
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=step_s)),
        load_state_dict=None, state_dict=None,
        min_replica_size=int(os.environ.get(MIN_REPLICAS_VAR, "1")),
        use_async_quorum=False, rank=0, world_size=1,
        store_addr=host, store_port=store.port,
        lighthouse_addr=os.environ.get(LIGHTHOUSE_VAR),
        replica_id=replica_name(),
        hostname=host,  # where peers reach its server (a heal's transfer too)
        timeout=timedelta(seconds=step_s), quorum_timeout=timedelta(seconds=quorum_s),
        connect_timeout=timedelta(seconds=min(quorum_s, 30.0)),
        heartbeat_interval=timedelta(milliseconds=100),
        checkpoint_transport=_transport(timedelta(seconds=step_s)))
    manager._ddpkit_store = store  # the store lives as long as the manager
    return manager


class LiveEngine(TorchEngine):
    """The engine of a fault-tolerant run (chosen by ``setup()`` when ``ddpkit run
    --fault-tolerant`` started this process). ``wrap`` is DDP whose gradients go through
    torchft's Manager, weighted by each replica's share of the step's samples.

    Example::

        rt = ddpkit.setup()        # under ddpkit run --fault-tolerant: engine=live
        model = rt.wrap(Net())     # gradients summed over the live replicas
    """

    name = "live"

    @classmethod
    def running(cls) -> bool:
        return _CURRENT is not None

    def unavailable(self) -> Optional[str]:
        return torchft_missing()

    def start(self, env: ClusterEnv, device: torch.device, backend: Optional[str],
              init_method: Optional[str], timeout: timedelta) -> Optional[str]:
        """A group of one (this replica) and torchft's Manager, joined to the lighthouse."""
        global _CURRENT
        missing = torchft_missing()
        if missing:
            raise ConfigError(missing)

        if env.world_size != 1:
            raise ConfigError("a fault-tolerant replica is one process (ddpkit run "
                              "--fault-tolerant starts them); this one was started with "
                              f"WORLD_SIZE={env.world_size}")
        here = int(os.environ.get(REPLICAS_HERE_VAR, "1"))  # replicas sharing this node's cores
        if device.type == "cpu" and here > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // here))
        quorum_s = float(os.environ.get(QUORUM_TIMEOUT_VAR, "60"))
        step_s = min(timeout.total_seconds(), 30.0)  # a dead peer is seen when its socket closes
        # torchft reads a peer's state from bytes it received: torch warns they are read-only;
        # its manager warns at every quorum that NCCL's flight recorder cannot be reset
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        logging.getLogger("torchft").setLevel(logging.CRITICAL)  # each is handled: a step not committed
        _CURRENT = Live(functools.partial(_manager, step_s, quorum_s))
        if env.restart_count == 0:  # the job's start: the first quorum waits for every replica
            _CURRENT.manager  # heartbeating from here  # noqa: B018
        return "live"

    def shutdown(self) -> None:
        global _CURRENT
        if _CURRENT is not None:
            _CURRENT.shutdown()
        _CURRENT = None

    def wrap(self, model: nn.Module, env: ClusterEnv, device: torch.device,
             options: WrapOptions) -> nn.Module:
        """:class:`LiveModel`: gradients summed over the live replicas after each backward."""
        self.check_options(options)
        live = _CURRENT
        if live is None:
            raise ConfigError("rt.wrap: the fault-tolerant engine has not started")
        return LiveModel(model.to(device), live)

    def leads(self) -> bool:
        """Whether this replica prints and writes for the job now."""
        return _CURRENT is None or _CURRENT.leads()


def gate_optimizer(optimizer: torch.optim.Optimizer, live: Live,
                   on_skip: Optional[Callable[[], None]] = None) -> Any:
    """Step ``optimizer`` only when the step commits: before each ``step()`` every replica of the
    quorum says whether it finished; if one did not, the gradients are dropped (a torch
    optimizer skips a parameter without one) and the step is given again."""
    def before_step(opt: Any, args: Any, kwargs: Any) -> None:
        if live.commit():
            return
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
        if on_skip is not None:
            on_skip()

    return optimizer.register_step_pre_hook(before_step)
