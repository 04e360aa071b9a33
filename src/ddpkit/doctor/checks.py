"""What ``ddpkit doctor`` looks at on each rank (versions, device, the interface and address
toward the master, a collective on the group's backend, the usual ports) and the findings rank 0
makes of all of them: one line each, a verdict and a fix.
"""
from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["Finding", "local_facts", "versions", "routes", "ports", "PORTS"]

#: The ports a job uses by default: torchrun's c10d rendezvous and the process-group store.
PORTS = (29400, 29500)


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's report. Example::

        Finding("versions", "ok", "torch 2.13.0 on 2 ranks")
    """

    name: str
    verdict: str          # "ok", "warn" or "FAIL"
    detail: str
    fix: str = ""

    def line(self) -> str:
        """``ok    versions: torch 2.13.0 on 2 ranks`` (and the fix after a dash)."""
        fix = f" - {self.fix}" if self.fix else ""
        return f"{self.verdict:<5} {self.name}: {self.detail}{fix}"


def local_facts(device: torch.device, master: Optional[str] = None) -> Dict[str, Any]:
    """What this rank is and runs, to be gathered by rank 0.

    Example::

        local_facts(torch.device("cpu"), "10.0.0.1")
    """
    from ..launchers.network import route_to

    cuda = torch.version.cuda if torch.cuda.is_available() else None
    nccl = ".".join(map(str, torch.cuda.nccl.version())) \
        if cuda and hasattr(torch.cuda, "nccl") else None
    try:
        route = route_to(master) if master else None
    except (OSError, ValueError):  # a master name that does not resolve here
        route = None
    return {"host": socket.gethostname(), "torch": torch.__version__,
            "python": platform.python_version(), "cuda": cuda, "nccl": nccl,
            "device": str(device), "device_name": torch.cuda.get_device_name(device)
            if device.type == "cuda" else platform.processor() or "cpu",
            "iface": getattr(route, "iface", None), "source": getattr(route, "src", None),
            "pid": os.getpid()}


def versions(facts: List[Dict[str, Any]]) -> Finding:
    """Every rank must run the same torch (and CUDA/NCCL): a mismatch hangs or corrupts
    collectives. Example::

        versions([{"torch": "2.13.0", "host": "a"}, {"torch": "2.11.0", "host": "b"}])
    """
    for key in ("torch", "cuda", "nccl", "python"):
        seen: Dict[str, List[str]] = {}
        for f in facts:
            seen.setdefault(str(f.get(key)), []).append(f["host"])
        if len(seen) > 1:
            where = "; ".join(f"{v} on {', '.join(sorted(set(h)))}" for v, h in seen.items())
            return Finding("versions", "FAIL", f"{key} differs between ranks: {where}",
                           f"install one {key} version on every node")
    first = facts[0]
    extra = "".join(f", {k} {first[k]}" for k in ("cuda", "nccl") if first.get(k))
    return Finding("versions", "ok", f"torch {first['torch']}, Python {first['python']}{extra} "
                                     f"on all {len(facts)} rank(s)")


def routes(facts: List[Dict[str, Any]], master: Optional[str]) -> Finding:
    """The interface and address each rank reaches the master through.

    Example::

        routes(facts, "10.0.0.1")
    """
    if not master:
        return Finding("network", "ok", "one process, no master to reach")
    seen = sorted({f"{f['host']} via {f['iface'] or '?'} ({f['source'] or '?'})" for f in facts})
    unknown = [f["host"] for f in facts if not f["iface"]]
    if unknown:
        return Finding("network", "warn", f"no route found to the master {master} from "
                                          f"{', '.join(sorted(set(unknown)))}",
                       "check `ip route get <master>` there, or pass --iface to ddpkit run")
    return Finding("network", "ok", f"master {master} reached: {'; '.join(seen)}")


def ports(host: str = "127.0.0.1", own: Sequence[int] = ()) -> Finding:
    """Are the default rendezvous and store ports free on this host (but for ``own``, this
    job's)?

    Example::

        ports()   # ok    ports: 29400, 29500 free on this host
    """
    from ..launchers.network import port_in_use

    busy = [p for p in PORTS if p not in own and port_in_use(host, p)]
    if busy:
        return Finding("ports", "warn", f"{', '.join(map(str, busy))} in use on this host (another "
                                        "job?)", "ddpkit run picks a free port by itself; with "
                                                 "--rdzv-endpoint give another port")
    mine = [p for p in PORTS if p in own]
    said = f" ({', '.join(map(str, mine))}: this job's)" if mine else ""
    return Finding("ports", "ok", f"{', '.join(map(str, PORTS))} free on this host{said}")
