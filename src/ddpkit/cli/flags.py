"""The launch flags, declared once: ``ddpkit run`` and ``ddpkit train`` share them, and
:func:`run_config` maps them onto the launcher's :class:`~ddpkit.launchers.torchrun.RunConfig`.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..base.errors import ConfigError
from ..env.detect import BACKEND_VAR, TIMEOUT_VAR
from ..env.dist import BACKENDS
from ..env.k8s import pod_launch
from ..faults.stall import AFTER_VAR as STALL_VAR
from ..launchers.forked import START_METHODS
from ..launchers.torchrun import RunConfig

__all__ = ["add_launch_flags", "pass_backend", "pass_timeout", "add_stall_flag", "pass_stall_after", "run_config", "parse_nnodes", "from_pod"]

# (flags, argparse keywords): the RunConfig field is the dest.
_LAUNCH_FLAGS = (
    (("--nnodes",), dict(default=None, metavar="N|MIN:MAX",
                         help="number of nodes (default 1, or a pod's PET_NNODES), or MIN:MAX "
                              "for an elastic job that goes on while at least MIN nodes remain "
                              "and grows back to MAX")),
    (("--node-rank",), dict(type=int, default=None,
                            help="this node's rank (static rendezvous with --master-addr; "
                                 "default 0, or a pod's PET_NODE_RANK / JOB_COMPLETION_INDEX)")),
    (("--master-addr",), dict(help="address of node 0 (static rendezvous)")),
    (("--master-port",), dict(type=int, help="port on node 0 (default: a free one)")),
    (("--rdzv-endpoint",), dict(help="HOST:PORT of the c10d rendezvous (multi-node, elastic)")),
    (("--rdzv-id",), dict(help="job id shared by all nodes (default 'ddpkit'; torchrun's run id "
                               "adds the node count, so nodes that disagree never meet)")),
    (("--rdzv-timeout",), dict(type=float, metavar="SECONDS",
                               help="several nodes: every node must join within this many "
                                    "seconds of the first (default: torchrun's 600)")),
    (("--rdzv-last-call",), dict(type=float, metavar="SECONDS",
                                 help="--nnodes MIN:MAX: once MIN nodes have joined, wait this "
                                      "long for more before starting (default 10)")),
    (("--max-restarts",), dict(type=int, default=None,
                               help="restart the whole group this many times when a worker "
                                    "dies (ddpkit train resumes from its checkpoints; default "
                                    "0, or 10 with --nnodes MIN:MAX)")),
    (("--iface",), dict(help="network interface for gloo/nccl traffic (e.g. eth1)")),
    (("--log-dir",), dict(help="directory for per-rank logs (torchrun --log-dir)")),
    (("-v", "--verbose"), dict(action="store_true", help="show torchrun's agent logs")),
    (("--start-method",), dict(choices=START_METHODS, default="forkserver",
                               help="how a node's workers start: forkserver (default: forked "
                                    "from a server that imported torch once) or spawn "
                                    "(torchrun's: each a fresh `python -u SCRIPT`)")),
    (("--fault-tolerant",), dict(action="store_true", default=None,
                                 help="each process a replica: a lost one is restarted alone "
                                      "and takes a live peer's state while the others keep "
                                      "training, every sample once (torchft underneath: pip "
                                      "install 'ddpkit[ft]'; docs/failures.md)")),
    (("--min-replicas",), dict(type=int, default=None, metavar="N",
                               help="--fault-tolerant: steps commit while at least N replicas "
                                    "are alive (default: a majority of them; fewer lets a lone "
                                    "survivor train on, and two groups cut apart train apart)")),
    (("--lighthouse",), dict(metavar="HOST:PORT",
                             help="--fault-tolerant on several nodes: the lighthouse that keeps "
                                  "the quorum; node rank 0 starts it there (default on one "
                                  "node: a free port here)")),
)
# Each number's range, checked before anything starts: (least, most), None for no bound.
_RANGES = {"node_rank": (0, None), "min_replicas": (1, None), "master_port": (1, 65535),
           "max_restarts": (0, None), "rdzv_timeout": (0, None), "rdzv_last_call": (0, None)}
_FIELDS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id",
           "rdzv_timeout", "rdzv_last_call", "max_restarts", "iface", "log_dir", "verbose",
           "start_method", "fault_tolerant", "min_replicas", "lighthouse")


def add_launch_flags(parser: argparse.ArgumentParser,
                     only: Optional[Sequence[str]] = None) -> None:
    """Add the launch flags (nodes, rendezvous, restarts, interface, logs) to ``parser``;
    ``only`` names the ``RunConfig`` fields to add (default: all).

    Example::

        add_launch_flags(sub.add_parser("run"))
        add_launch_flags(sub.add_parser("slurm"), only=["rdzv_timeout", "max_restarts"])
    """
    group = parser.add_argument_group("launch (torchrun underneath)")
    for (flags, kwargs), name in zip(_LAUNCH_FLAGS, _FIELDS):
        if only is None or name in only:
            group.add_argument(*flags, **kwargs)


def pass_backend(backend: Optional[str]) -> None:
    """Hand ``--backend`` to the ranks' ``ddpkit.setup()`` through the environment they inherit
    (``DDPKIT_BACKEND``); None leaves it as it is. An unknown name is one line here, before launch.

    Example::

        pass_backend("gloo")   # 2 ranks of `ddpkit run --nproc 2` share one GPU
    """
    if backend:
        if backend not in BACKENDS:
            raise ConfigError(f"--backend {backend!r} is not a backend; use one of "
                              f"{', '.join(BACKENDS)}, or leave it out for the automatic choice")
        os.environ[BACKEND_VAR] = backend


def pass_timeout(seconds: Optional[float]) -> None:
    """Hand ``--timeout`` (a collective's, in seconds) to the ranks' ``ddpkit.setup()``
    (``DDPKIT_TIMEOUT``); one line for a value that is not a positive number.

    Example::

        pass_timeout(120)   # a stuck rank is reported after 2 minutes, not 10
    """
    if seconds is None:
        return
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"--timeout must be a number of seconds > 0, got {seconds:g}")
    os.environ[TIMEOUT_VAR] = repr(float(seconds))


def add_stall_flag(parser: argparse.ArgumentParser) -> None:
    """``--stall-after S``: seconds the ranks wait for one that does not move before it is named.

    Example::

        add_stall_flag(sub.add_parser("run"))
    """
    parser.add_argument("--stall-after", type=float, default=None, metavar="S",
                        help="seconds the other ranks wait for a rank that makes no progress "
                             "before it is named with its stack (default 5; 0: off); the job "
                             "goes on waiting until --timeout")


def pass_stall_after(seconds: Optional[float]) -> None:
    """Hand ``--stall-after`` to the ranks (``DDPKIT_STALL_AFTER``); one line for a value that
    is not a number of seconds >= 0.

    Example::

        pass_stall_after(0)   # no stall reports
    """
    if seconds is None:
        return
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"--stall-after must be a number of seconds >= 0 (0: off), "
                          f"got {seconds:g}")
    os.environ[STALL_VAR] = repr(float(seconds))


def run_config(ns: argparse.Namespace, script: str, script_args: Optional[List[str]] = None,
               **fields: Any) -> RunConfig:
    """The :class:`RunConfig` the parsed launch flags describe, for ``script``.

    Example::

        run_config(parser.parse_args(["run", "--nnodes", "2", "t.py"]), "t.py", nproc="2")
    """
    values = {name: getattr(ns, name, None) for name in _FIELDS}
    values = {name: value for name, value in values.items() if value is not None}
    values.update({k: v for k, v in fields.items() if v is not None})
    values = from_pod(values, os.environ)
    if "nnodes" in values:
        values["min_nodes"], values["nnodes"] = parse_nnodes(values["nnodes"])
    _check_ranges(values)
    return RunConfig(script=script, script_args=list(script_args or []), **values)


def from_pod(values: Dict[str, Any], environ: Mapping[str, str]) -> Dict[str, Any]:
    """``values`` with what a Kubernetes pod says filled in where no flag was given: Kubeflow
    Trainer's ``PET_*`` (nodes, processes, node rank; its master as the c10d rendezvous
    endpoint) or an Indexed Job's ``JOB_COMPLETION_INDEX`` (the node rank).

    Example::

        from_pod({}, {"PET_NNODES": "2", "PET_MASTER_ADDR": "j-node-0-0.j",
                      "PET_MASTER_PORT": "29500"})
        # {'nnodes': '2', 'rdzv_endpoint': 'j-node-0-0.j:29500'}
    """
    pod = pod_launch(environ)
    if pod is None:
        return values
    said = {"nnodes": pod.nnodes, "nproc": pod.nproc, "node_rank": pod.node_rank,
            "rdzv_endpoint": pod.endpoint}
    if values.get("master_addr") or values.get("rdzv_endpoint"):
        said.pop("rdzv_endpoint")  # a meeting point given on the command line wins whole
    return {**{k: v for k, v in said.items() if v is not None}, **values}


def parse_nnodes(text: Any) -> Tuple[Optional[int], int]:
    """``--nnodes N`` or ``MIN:MAX`` as ``(MIN or None, MAX)``; one line for anything else.

    Example::

        parse_nnodes("2"), parse_nnodes("2:3")   # (None, 2), (2, 3)
    """
    lo, sep, hi = str(text).strip().partition(":")
    try:
        least, most = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ConfigError(f"--nnodes must be a node count N or a range MIN:MAX such as 2:4, "
                          f"got {text!r}") from None
    if least < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {text}")
    if least > most:
        raise ConfigError(f"--nnodes {text}: MIN ({least}) is larger than MAX ({most}); "
                          f"write --nnodes {most}:{least}")
    return (least if sep and least < most else None), most  # 2:2 is 2


def _check_ranges(values: Dict[str, Any]) -> None:
    for name, (least, most) in _RANGES.items():
        value = values.get(name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name in ("rdzv_timeout", "rdzv_last_call") and value <= 0:
            raise ConfigError(f"{flag} must be > 0 seconds, got {value}")
        if value < least or (most is not None and value > most):
            bound = f"between {least} and {most}" if most is not None else f">= {least}"
            raise ConfigError(f"{flag} must be {bound}, got {value}")
