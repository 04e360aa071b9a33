"""The doctor itself, on every rank of a job (``ddpkit run ... -m ddpkit.doctor``, or one plain
process): gather each rank's facts, check, measure, and print one line per finding from rank 0;
exit 1 when any finding fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import List, Optional

from ..env.dist import DEFAULT_TIMEOUT
from ..base.errors import ConfigError

__all__ = ["main", "parse_size"]


def parse_size(text: str) -> int:
    """``256M``, ``64K``, ``1G`` or a number of bytes.

    Example::

        parse_size("256M")   # 268435456
    """
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("IB")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        value = 0
    if value < 1024:
        raise ConfigError(f"--max-bytes {text!r}: give a size of at least 1K, like 64M or 1G")
    return value


def check_numbers(params: Optional[int], timeout_s: float) -> None:
    """One line for a parameter count below 1 or a timeout that is not positive.

    Example::

        check_numbers(0, 600)   # ConfigError: --params must be >= 1
    """
    if params is not None and params < 1:
        raise ConfigError(f"--params must be >= 1, got {params}")
    if not timeout_s > 0:
        raise ConfigError(f"--timeout-s must be > 0, got {timeout_s:g}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddpkit.doctor")
    p.add_argument("--output", help="the checkpoint directory to check (shared by the nodes?)")
    p.add_argument("--max-bytes", default="64M", help="largest all-reduce of the sweep")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON (rank 0)")
    p.add_argument("--params", type=int, help="a model's parameter count: does its all-reduce "
                                              "fit the collective timeout?")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT.total_seconds(),
                   help="the job's collective timeout (ddpkit train --timeout-s; default 600)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run the doctor on this rank; rank 0 prints and returns 1 if anything failed.

    Example::

        main(["--output", "/shared/ckpt", "--max-bytes", "16M"])
    """
    import ddpkit
    import torch.distributed as tdist

    from . import checks, cluster

    ns = _parser().parse_args(argv)
    max_bytes = parse_size(ns.max_bytes)
    check_numbers(ns.params, ns.timeout_s)
    rt = ddpkit.setup()
    master = os.environ.get("MASTER_ADDR") if rt.world_size > 1 else None
    before = time.time()
    facts = rt.gather_object(checks.local_facts(rt.device, master))
    stamps = rt.gather_object((before, time.time()))
    findings = [checks.versions(facts), cluster.collective(rt.device),
                checks.routes(facts, master), checks.ports(own=_own_ports()),
                cluster.shared(ns.output, rt.env.num_nodes)]
    if rt.world_size > 1:
        findings.append(cluster.clocks(stamps))
        rows = cluster.sweep(rt.device, cluster.sweep_sizes(max_bytes))
        finding, link = cluster.link_finding(rows, rt.world_size)
        shared_cores = cluster.overlap(rt.device, rows)
        link = dataclasses.replace(link, overlap=shared_cores["overlap"])
        findings += [finding, cluster.overlap_finding(shared_cores),
                     cluster.timeout_finding(link, rt.world_size, ns.timeout_s,
                                             ns.params, max(r["busbw"] for r in rows))]
    else:
        rows, link = [], None
        findings.append(checks.Finding("link", "ok", "one process: nothing to measure; run "
                                                      "ddpkit doctor --nproc N or under ddpkit "
                                                      "run on every node"))
    failed = any(f.verdict == "FAIL" for f in findings)
    if rt.is_main:
        for f in findings:
            print(f.line(), flush=True)
        _sweep_table(rows)
        if ns.json:
            _write_json(ns.json, facts, findings, rows, link, rt.world_size)
    if tdist.is_initialized():
        tdist.barrier()
    rt.shutdown()
    return 1 if failed else 0


def _own_ports() -> List[int]:
    """The ports this job holds: its store's and its rendezvous's (``ddpkit run`` says which)."""
    from ..launchers.network import split_endpoint
    from ..launchers.torchrun import RDZV_ENDPOINT_VAR

    if "RANK" not in os.environ:
        return []
    port, endpoint = os.environ.get("MASTER_PORT", ""), os.environ.get(RDZV_ENDPOINT_VAR)
    own = [int(port)] if port.isdigit() else []
    return own + ([split_endpoint(endpoint)[1]] if endpoint else [])


def _sweep_table(rows: list) -> None:
    if not rows:
        return
    print(f"{'bytes':>12} {'time us':>10} {'algbw MB/s':>11} {'busbw MB/s':>11}")
    for r in rows:
        print(f"{r['bytes']:>12} {r['seconds'] * 1e6:>10.1f} {r['algbw'] / 1e6:>11.1f} "
              f"{r['busbw'] / 1e6:>11.1f}")


def _write_json(path: str, facts: list, findings: list, rows: list, link, world: int) -> None:
    data = {"ranks": world, "facts": facts,
            "findings": [dataclasses.asdict(f) for f in findings], "sweep": rows,
            "link": None if link is None else {"alpha": link.alpha, "beta": link.beta,
                                               "overlap": link.overlap, "ranks": world}}
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
