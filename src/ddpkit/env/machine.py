"""Facts about this machine that training decisions depend on: CPU model and flags, native
bf16, core count, load. Pure reads; nothing is changed.
"""
from __future__ import annotations

import os
import platform
import time
from typing import Any, Dict, List, Optional

import torch

__all__ = ["cpu_info", "native_bf16", "bf16_slowdown", "loadavg"]

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


def loadavg() -> Optional[List[float]]:
    """The 1, 5 and 15 minute load averages, or None where the OS does not report them.

    Example::

        loadavg()   # [0.52, 0.61, 0.7]
    """
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None
