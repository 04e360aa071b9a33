"""The random generators a script draws from, as ``ddpkit verify``'s probe reads them: where
they stand (torch's, the GPU's, Python's ``random`` and NumPy's global ones), a checksum alike in
every process for equal states (the ranks' generators compared), and whether anything was drawn
between two readings. Nothing here runs outside ``ddpkit verify``.
"""
from __future__ import annotations

import array
import random
import sys
import zlib
from typing import Any, List

import torch

__all__ = ["rng", "rng_digest", "same"]


def rng() -> List[Any]:
    """Where every generator a script draws from stands: torch's CPU generator, the current
    GPU's once CUDA is in use (dropout on a GPU draws from that one), and the global ones of
    Python's ``random`` and of NumPy (as checksums of their states).

    Example::

        before = rng(); noise = np.random.rand(); same(before, rng())   # False
    """
    states: List[Any] = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    version, words, gauss = random.getstate()  # a checksum alike in every process (not hash())
    states.append((zlib.crc32(array.array("Q", words).tobytes()), gauss))
    numpy = sys.modules.get("numpy")  # only where the script (or a library) imported it
    if numpy is not None:
        _, keys, pos, *_rest = numpy.random.get_state()
        states.append((zlib.crc32(keys.tobytes()), int(pos)))
    return states


def rng_digest(states: List[Any]) -> int:
    """One checksum of an :func:`rng` reading: the ranks' generators compared by it.

    Example::

        rng_digest(rng()) == rng_digest(rng())   # True: nothing drawn between
    """
    return zlib.crc32(repr([zlib.crc32(x.numpy().tobytes()) if torch.is_tensor(x) else x
                            for x in states]).encode())


def same(a: List[Any], b: List[Any]) -> bool:
    """Whether two :func:`rng` readings are equal: nothing drawn between them."""
    return len(a) == len(b) and all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))
