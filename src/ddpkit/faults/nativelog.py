"""Quiet torch's native warnings around a diagnostic's own store calls. A TCPStore client whose
server is gone (a restart: the rank that held the store ended; a lost node) prints a C++
warning with its whole native stack trace before it raises, and a diagnostic thread that polls
the store (the stall watch, a launcher answering stack asks) would print one each time it
tries: a traceback storm for an error it handles by trying later. While any thread is inside
:func:`quiet_native_warnings`, libc10's log level is ERROR; then it is what it was. A level the
user chose (``TORCH_CPP_LOG_LEVEL``) is left alone.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any, Dict, Iterator, Optional

__all__ = ["quiet_native_warnings"]

_ERROR = 2  # c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL
_LOCK = threading.Lock()
_STATE: Dict[str, Any] = {"flag": None, "looked": False, "depth": 0, "saved": None}


def _level_flag() -> Optional[ctypes.c_int]:
    """libc10's ``FLAGS_caffe2_log_level`` (what ``TORCH_CPP_LOG_LEVEL`` sets at import), or None
    where this torch does not export it."""
    if not _STATE["looked"]:
        _STATE["looked"] = True
        with contextlib.suppress(Exception):  # another torch or platform: warnings stay on
            import torch

            lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
            path = next(p for p in (os.path.join(lib_dir, name) for name in
                                    ("libc10.so", "libc10.dylib", "c10.dll")) if os.path.exists(p))
            _STATE["flag"] = ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
    return _STATE["flag"]


@contextlib.contextmanager
def quiet_native_warnings() -> Iterator[None]:
    """No native (C++) warning is printed while inside; errors still are.

    Example::

        with quiet_native_warnings():
            store.add("asks", 0)   # a store that is gone raises, and prints nothing
    """
    with _LOCK:
        flag = None if os.environ.get("TORCH_CPP_LOG_LEVEL") else _level_flag()
        if flag is not None:
            if _STATE["depth"] == 0:
                _STATE["saved"] = flag.value
                flag.value = max(flag.value, _ERROR)
            _STATE["depth"] += 1
    try:
        yield
    finally:
        if flag is not None:
            with _LOCK:
                _STATE["depth"] -= 1
                if _STATE["depth"] == 0:
                    flag.value = _STATE["saved"]
