"""Can this node hold ``--nproc`` workers? Its cores and memory, read before any worker starts:
a refusal with the numbers when they cannot fit, a warning when a CPU-only run outnumbers cores.

torchrun starts whatever it is asked for: 64 workers on a 2-core, 24 GB machine passed 7 GB in
10 s before anything said a word.

A worker is counted at what this launcher holds once torch is imported (its private memory, not
the shared libraries): a floor, since a worker imports the same and then builds its model and data.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from ..base.errors import ConfigError

__all__ = ["check_memory", "cores_warning", "usable_cores", "available_memory", "worker_floor"]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's count).

    Example::

        usable_cores()   # 2
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def available_memory() -> Optional[int]:
    """Bytes of memory new processes can take here: the kernel's ``MemAvailable``, or less under
    a container's cgroup limit; None where neither can be read (not Linux).

    Example::

        available_memory()   # 23439716352
    """
    found = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    return min(found) if found else None


def worker_floor() -> int:
    """Bytes a worker holds at least: this process's own (private) memory, torch imported.

    Example::

        worker_floor()   # 150040576
    """
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line and line[0].isupper())
        return sum(int(fields[k].split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))
    except (OSError, KeyError, ValueError):
        import resource  # the peak resident set, shared pages included: an upper floor

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_memory(nproc: int) -> None:
    """Raise :class:`ConfigError` with the numbers when ``nproc`` workers cannot fit in this
    node's available memory even at :func:`worker_floor` each.

    Example::

        check_memory(64)   # ConfigError on a machine with 7.5 GB free
    """
    available, floor = available_memory(), worker_floor()
    if available is None or nproc * floor <= available:
        return
    most = max(1, available // floor)
    raise ConfigError(f"--nproc {nproc} cannot fit in this node's memory: {nproc} workers need "
                      f"at least {_gb(nproc * floor)} ({floor / 1e6:.0f} MB each, what a process "
                      "holds once torch is imported, before any model or data) and "
                      f"{_gb(available)} is available; use --nproc {most} or fewer "
                      f"({usable_cores()} CPU cores here)")


def cores_warning(nproc: int, gpus: int) -> Optional[str]:
    """The warning for a CPU-only run (``gpus`` 0) of more workers than cores, with the numbers;
    None when there is nothing to say.

    Example::

        cores_warning(64, gpus=0)   # 'warning: --nproc 64 on 2 CPU cores and no GPU: ...'
    """
    cores = usable_cores()
    if gpus or nproc <= cores:
        return None
    available, floor = available_memory(), worker_floor()
    memory = (f"; they need at least {_gb(nproc * floor)} of the {_gb(available)} available "
              f"({floor / 1e6:.0f} MB each before any model or data)" if available else "")
    return (f"warning: --nproc {nproc} on {cores} CPU core{'s' if cores > 1 else ''} and no GPU: "
            f"each worker gets 1/{-(-nproc // cores)} of a core and every step waits for the "
            f"slowest{memory}; on CPU --nproc {cores} (one per core) is usually fastest")


def _gb(size: float) -> str:
    return f"{size / 1e9:.1f} GB"


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> Optional[int]:
    """A cgroup's limit less its usage (v2, then v1); None with no limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f, open(usage) as g:
                cap, used = f.read().strip(), int(g.read().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:  # "max" or v1's huge number: no limit
            return max(0, int(cap) - used)
    return None
