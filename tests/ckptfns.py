"""Functions run on every rank by ddpkit.launch in test_checkpoint (must be importable)."""
import os

import torch

import ddpkit
from ddpkit.engines import comm
from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
from ddpkit.base.errors import DDPKitError


def save_then_fail(directory: str, not_a_directory: str):
    """Two saves from every rank, then a save that fails on rank 0; what each rank saw."""
    rt = ddpkit.setup()
    # Different state per rank: the file must hold rank 0's, proving only rank 0 wrote.
    state = {"w": torch.full((3,), float(rt.rank)), "rank": rt.rank}
    returned = [save_checkpoint(state, directory, step, keep=1) for step in (1, 2)]
    listing = sorted(os.listdir(directory))
    loaded = load_checkpoint(os.path.join(directory, "ckpt-000000002.pt"))
    try:
        save_checkpoint(state, not_a_directory, 3)
        error = None
    except DDPKitError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"returned": comm.gather_object([str(p) if p else None for p in returned]),
            "listing": comm.gather_object(listing), "saved_rank": loaded["rank"],
            "errors": comm.gather_object(error)}
