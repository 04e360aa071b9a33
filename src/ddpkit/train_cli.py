"""``ddpkit train``: flags generated from :class:`TrainConfig`, checked here, then launched.

The launching process validates everything it can, writes the resolved config into the run
directory, and starts the workers through ``ddpkit run`` (torchrun) with ``-m ddpkit.train``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Dict

import torch

from .config import TrainConfig, merge
from .errors import ConfigError

__all__ = ["add_parser", "resolve"]


def _flag_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(hints[f.name])
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_text)
        else:
            p.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text,
                           choices=f.metadata.get("choices"), dest=f.name)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit train``."""
    p = sub.add_parser("train", help="train a built-in model on a built-in dataset",
                       description="Train a built-in model. With no flags: the small CNN on "
                                   "the embedded digits dataset, 2 processes, exact evaluation.")
    p.add_argument("--config", help="YAML or TOML file with TrainConfig keys (flags win)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-timeout", type=float, metavar="SECONDS",
                   help="several nodes: every node must join within this many seconds of the "
                        "first (default: torchrun's 600)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart workers this many times on failure (resumes from checkpoint)")
    p.add_argument("--iface", help="network interface for gloo/nccl traffic")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_train)


def resolve(ns: argparse.Namespace) -> TrainConfig:
    """Defaults < ``--config`` file < flags given on the command line."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    flags: Dict[str, Any] = {k: v for k, v in vars(ns).items() if k in names}
    return merge(ns.config, flags)


def _cmd_train(ns: argparse.Namespace) -> int:
    from .launchers import RunConfig, run
    from .train import check_config, train

    cfg = resolve(ns)
    if ns.max_restarts and not cfg.resume:
        cfg = dataclasses.replace(cfg, resume="auto")  # a restarted worker must pick up its work
    inside_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if inside_launcher else cfg.nproc * ns.nnodes
    if cfg.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {cfg.nproc}")
    check_config(cfg, world, torch.cuda.is_available())
    os.makedirs(cfg.output, exist_ok=True)
    path = os.path.join(cfg.output, "config.json")
    cfg.dump(path)
    print("resolved config (saved to {}):\n{}".format(path, _pretty(cfg)), flush=True)
    if inside_launcher or (cfg.nproc == 1 and ns.nnodes == 1 and not ns.max_restarts):
        train(cfg)
        return 0
    if cfg.strategy == "horovod":
        return _run_horovod(cfg, ns, path)
    return run(RunConfig(script="ddpkit.train", module=True, script_args=[path], nproc=cfg.nproc,
                         nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                         master_port=ns.master_port, rdzv_endpoint=ns.rdzv_endpoint,
                         rdzv_timeout=ns.rdzv_timeout, max_restarts=ns.max_restarts,
                         iface=ns.iface))


def _run_horovod(cfg: TrainConfig, ns: argparse.Namespace, path: str) -> int:
    """``--strategy horovod``: the workers run under ``horovodrun`` (gloo) on this host."""
    from . import horovod_engine

    if ns.nnodes != 1 or ns.max_restarts:
        raise ConfigError("--strategy horovod runs on one node without restarts from `ddpkit "
                          "train`; for several hosts run `horovodrun -H ... python -m "
                          f"ddpkit.train {path}` yourself")
    return horovod_engine.run(cfg.nproc, [sys.executable, "-m", "ddpkit.train", path])


def _pretty(cfg: TrainConfig) -> str:
    return "\n".join(f"  {k}: {v}" for k, v in cfg.to_dict().items())
