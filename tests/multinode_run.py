"""``ddpkit run`` plus the multi-node wiring proposed for launchers.py (benchmarks/MULTINODE.md).

Once ``ddpkit.launchers.run`` calls :mod:`ddpkit.net` itself (it then sets ``NET_WIRED``), this
file just runs ``ddpkit run``. Also takes the proposed ``--rdzv-timeout SECONDS`` flag.

    python tests/multinode_run.py --nnodes 2 --nproc 1 --rdzv-endpoint 10.213.0.1:29400 SCRIPT ...
"""
from __future__ import annotations

import ipaddress
import os
import sys
from typing import List, Optional

from ddpkit import launchers, net
from ddpkit.cli import main
from ddpkit.errors import ConfigError


def _static_checks(cfg: launchers.RunConfig) -> None:
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


def wired_run(cfg: launchers.RunConfig, original=launchers.run,
              rdzv_timeout: Optional[float] = None) -> int:
    """What ``launchers.run`` would do with the proposed change."""
    if cfg.nnodes <= 1:
        return original(cfg)
    launchers._validate(cfg)
    if not cfg.rdzv_endpoint:
        _static_checks(cfg)
        extra = ["--rdzv-conf", f"timeout={int(rdzv_timeout)}"] if rdzv_timeout else []
        endpoint = f"{cfg.master_addr}:{cfg.master_port or 29500}"
        try:
            return _with_args(cfg, original, extra)
        except Exception as exc:
            raise net.rendezvous_failure(exc, endpoint, cfg.nnodes, rdzv_timeout) or exc
    plan = net.node_network(cfg.rdzv_endpoint, cfg.iface)
    os.environ.update(net.socket_env(plan.iface))
    # A fresh store per rendezvous round (hosted by worker rank 0): no stale keys after restarts.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    extra = net.torchrun_extra_args(plan, join_timeout=rdzv_timeout)
    net.watch_nnodes(cfg.rdzv_endpoint, cfg.nnodes, cfg.rdzv_id or "ddpkit", rdzv_timeout or 600,
                     is_host=plan.is_host)
    with net.AgentWatchdog(cfg.rdzv_endpoint):
        try:
            return _with_args(cfg, original, extra)
        except Exception as exc:
            raise net.rendezvous_failure(exc, cfg.rdzv_endpoint, cfg.nnodes, rdzv_timeout) or exc


def _with_args(cfg: launchers.RunConfig, original, extra: List[str]) -> int:
    """Run with ``extra`` torchrun flags before the script (torchrun_args, patched)."""
    plain = launchers.torchrun_args

    def with_extra(c: launchers.RunConfig, nproc: int) -> List[str]:
        args = plain(c, nproc)
        cut = len(args) - 1 - len(c.script_args)  # before the script and its arguments
        return args[:cut] + extra + args[cut:]

    launchers.torchrun_args = with_extra
    return original(cfg)


def _pop_flag(argv: List[str], flag: str) -> Optional[str]:
    if flag in argv:
        i = argv.index(flag)
        value = argv[i + 1]
        del argv[i:i + 2]
        return value
    return None


if __name__ == "__main__":
    argv = sys.argv[1:]
    timeout = _pop_flag(argv, "--rdzv-timeout")
    if not getattr(launchers, "NET_WIRED", False):
        launchers.run = lambda cfg: wired_run(cfg, rdzv_timeout=float(timeout) if timeout else None)
    elif timeout:
        argv = ["--rdzv-timeout", timeout] + argv
    sys.exit(main(["run", *argv]))
