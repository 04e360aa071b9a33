"""Seeding and determinism: one call for Python, NumPy and torch; RNG state capture for resume.

Model initialisation must be identical on every rank (same seed); augmentation must differ
(the data loader offsets worker seeds by rank). ``seed_everything`` does the former.
"""
from __future__ import annotations

import contextlib
import os
import random
from typing import Any, Dict, Iterator

import torch

__all__ = ["seed_everything", "set_deterministic", "rng_state", "set_rng_state", "preserved_rng"]


def seed_everything(seed: int, rank_offset: int = 0) -> int:
    """Seed Python, NumPy (if installed) and torch (CPU and CUDA) with ``seed + rank_offset``.

    Use ``rank_offset=0`` before building the model so every rank starts from the same weights.

    Example::

        seed_everything(42)                         # identical on every rank
        seed_everything(42, rank_offset=env.rank)   # per-rank streams, e.g. dropout noise
    """
    value = (seed + rank_offset) % (2 ** 32)
    random.seed(value)
    torch.manual_seed(value)
    try:
        import numpy as np
        np.random.seed(value)
    except ImportError:
        pass
    return value


def set_deterministic(enabled: bool = True) -> None:
    """Ask torch for deterministic kernels (and turn off cuDNN autotuning, which contradicts it).

    Example::

        set_deterministic(True)
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled and torch.backends.cudnn.benchmark


def rng_state() -> Dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU, CUDA) for a checkpoint.

    Example::

        state = rng_state(); ...; set_rng_state(state)
    """
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        # Plain types and tensors only: checkpoints are loaded with weights_only=True.
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                          int(has_gauss), float(gauss)]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This process's own GPU only: reading every device's state would create a CUDA
        # context on each GPU from every rank.
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (missing parts are left alone).

    Example::

        set_rng_state(checkpoint["rng"][rank])
    """
    if "python" in state:
        random.setstate(_as_python_state(state["python"]))
    if "torch" in state:  # CPU state, whatever device the checkpoint was mapped to
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if not torch.cuda.is_available():
        return  # a GPU run resumed on CPU: the CPU streams are all there is
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"].cpu())
    elif "cuda" in state:  # older checkpoints hold every device's state: take this device's
        index = torch.cuda.current_device()
        if index < len(state["cuda"]):
            torch.cuda.set_rng_state(state["cuda"][index].cpu())


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block without moving this process's RNG streams (Python, NumPy, torch, this GPU's):
    whatever it draws, the code after it draws what it would have drawn without it.

    Example::

        with preserved_rng():
            metrics = evaluate(model, val_set)   # training's next batches are unchanged
    """
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def _as_python_state(value: Any) -> tuple:
    # Round-tripping through a weights-only checkpoint turns tuples into lists.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)
