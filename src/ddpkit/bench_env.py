"""The machine a ``ddpkit bench`` ran on: CPU, cores, torch, devices, GPU topology, load.

Also the capability checks that decide which rows can run here (CUDA, Horovod, native bf16).
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

__all__ = ["cpu_info", "native_bf16", "bf16_slowdown", "environment"]

_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16 / AMX; Arm's "bf16"


def cpu_info(path: str = "/proc/cpuinfo") -> Dict[str, Any]:
    """CPU model name and feature flags of the first processor listed in ``path``.

    Example::

        cpu_info()["model"]   # 'AMD EPYC'
    """
    info: Dict[str, Any] = {"model": platform.processor() or platform.machine(), "flags": []}
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and info["flags"] == []:
            info["model"] = value.strip()
        elif key in ("flags", "Features"):
            info["flags"] = value.split()
            break
    return info


def native_bf16(flags: List[str]) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX); otherwise oneDNN emulates it.

    Example::

        native_bf16(cpu_info()["flags"])
    """
    return any(f in flags for f in _BF16_FLAGS)


def bf16_slowdown(repeats: int = 3) -> float:
    """bf16-autocast / fp32 time of one small conv forward+backward here, single thread.

    A few hundred milliseconds; the measured ratio goes into the skip reason of bf16 rows.

    Example::

        bf16_slowdown()   # 9.8 on an AVX2-only CPU, below 1 with AMX
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        conv = torch.nn.Conv2d(32, 32, 3, padding=1, bias=False)
        x = torch.randn(8, 32, 16, 16)
        return _conv_time(conv, x, True, repeats) / _conv_time(conv, x, False, repeats)
    finally:
        torch.set_num_threads(threads)


def _conv_time(conv: torch.nn.Module, x: torch.Tensor, bf16: bool, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first call creates oneDNN primitives: min() drops it
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = conv(x)
        out.float().sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


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
        "devices": _devices(), "load_average_start": _loadavg(),
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


def _loadavg() -> Optional[List[float]]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None
