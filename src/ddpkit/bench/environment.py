"""The machine a ``ddpkit bench`` ran on: CPU, cores, torch, devices, GPU topology, load.

The CPU facts themselves (model, flags, native bf16) live in :mod:`ddpkit.env.machine`.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from ..env.machine import cpu_info, loadavg, native_bf16

__all__ = ["environment"]


def _run(cmd: List[str]) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _devices() -> Dict[str, Any]:
    if not torch.cuda.is_available():
        return {"type": "cpu", "cuda_count": 0, "gpus": [], "topology": None}
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"type": "cuda", "cuda_count": len(gpus), "gpus": gpus,
            "cuda_version": torch.version.cuda, "topology": _run(["nvidia-smi", "topo", "-m"])}


def environment(settings: Dict[str, Any]) -> Dict[str, Any]:
    """Everything needed to judge or repeat a run; ``settings`` are the bench's own choices.

    Example::

        env = environment({"batch_per_rank": 64, "threads_per_process": 1})
    """
    cpu = cpu_info()
    return {
        "command": _command_line(), "python_executable": sys.executable,
        "cpu_model": cpu["model"], "cpu_flags": cpu["flags"],
        "cpu_native_bf16": native_bf16(cpu["flags"]),
        "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__, "torch_cpu_capability": _cpu_capability(),
        "python": platform.python_version(), "platform": platform.platform(),
        "backend": "nccl" if torch.cuda.is_available() else "gloo",
        "devices": _devices(), "load_average_start": loadavg(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), **settings,
    }


def _command_line() -> str:
    prog = os.path.basename(sys.argv[0]) or "python"
    if prog == "__main__.py":  # started as ``python -m ddpkit``
        prog = "python -m ddpkit"
    return " ".join([prog] + sys.argv[1:])


def _cpu_capability() -> Optional[str]:
    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return get() if get else None
