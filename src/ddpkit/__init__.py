"""ddpkit: data-parallel PyTorch training done right.

Five lines make a plain script data-parallel under torchrun, Slurm, spawn or a single process::

    import ddpkit
    rt = ddpkit.setup(seed=0)
    model = rt.wrap(Net())
    loader = rt.loader(train_set, batch_size=256)      # global batch; set_epoch is automatic
    metrics = rt.evaluate(model, test_set)             # exact: no padding duplicates
"""
from __future__ import annotations

from .accumulate import Accumulator
from .comm import barrier, broadcast_object, gather_object, is_main, main_process_first, print0, reduce
from .data import DistributedLoader, make_loader
from .env import ClusterEnv, detect
from .errors import ConfigError, DDPKitError
from .evaluate import evaluate
from .launchers import launch
from .loop import CheckpointPolicy, Hook, fit
from .precision import Precision
from .runtime import Runtime, setup
from .seed import seed_everything
from .wrap import unwrap

__version__ = "0.1.0"

__all__ = [
    "Accumulator", "CheckpointPolicy", "ClusterEnv", "ConfigError", "DDPKitError", "DistributedLoader", "Precision",
    "Runtime", "barrier", "broadcast_object", "detect", "evaluate", "fit", "gather_object", "Hook", "is_main",
    "launch", "main_process_first", "make_loader", "print0", "reduce", "seed_everything",
    "setup", "unwrap", "__version__",
]
