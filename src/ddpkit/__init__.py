"""ddpkit: data-parallel PyTorch training done right.

Five lines make a plain script data-parallel under torchrun, Slurm, spawn or a single process::

    import ddpkit
    rt = ddpkit.setup(seed=0)
    model = rt.wrap(Net())
    loader = rt.loader(train_set, batch_size=256)      # global batch; set_epoch is automatic
    metrics = rt.evaluate(model, test_set)             # exact: no padding duplicates

The names below load when first used: ``import ddpkit`` itself imports neither torch nor any
launcher. The code lives in layers (docs/architecture.md): the training front a script calls in
:mod:`ddpkit.training`, the core's groups below it (:mod:`ddpkit.checkpoint`, :mod:`ddpkit.data`,
:mod:`ddpkit.engines`, :mod:`ddpkit.cost`, :mod:`ddpkit.faults`, :mod:`ddpkit.env`), the base under
them all (:mod:`ddpkit.base`); the products above (:mod:`ddpkit.launchers`, :mod:`ddpkit.job`,
:mod:`ddpkit.bench`, :mod:`ddpkit.cli`, ...).
"""
from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

from .base import moved as _moved
from .base.interrupts import quiet_worker as _quiet_worker
from .version import __version__

_quiet_worker()      # ddpkit's own worker: a Ctrl-C before setup() ends it quietly
_moved.install()     # modules that moved (ddpkit.comm, ddpkit.loop, ...) import by their old names

#: Each public name and the module that defines it (by name: loaded on first use).
_HOME = {
    "setup": "ddpkit.training.runtime", "Runtime": "ddpkit.training.runtime",
    "fit": "ddpkit.training.loop", "FitConfig": "ddpkit.training.loop",
    "CheckpointPolicy": "ddpkit.training.loop", "Hook": "ddpkit.training.loop",
    "evaluate": "ddpkit.training.evaluation", "Precision": "ddpkit.training.precision",
    "Accumulator": "ddpkit.training.accumulate", "Checkpointer": "ddpkit.checkpoint.checkpointer",
    "unwrap": "ddpkit.base.wrap", "DDPKitError": "ddpkit.base.errors",
    "ConfigError": "ddpkit.base.errors",
    # a product, the one the front door offers: started by name, so a rank's `import ddpkit`
    # never loads a launcher (torchrun's agent among them)
    "launch": "ddpkit.launchers.spawn",
    # also importable from here, as before the API was narrowed; their home (and documentation)
    # is the module named
    "barrier": "ddpkit.engines.comm", "broadcast_object": "ddpkit.engines.comm",
    "gather_object": "ddpkit.engines.comm", "is_main": "ddpkit.engines.comm",
    "main_process_first": "ddpkit.engines.comm", "print0": "ddpkit.engines.comm",
    "reduce": "ddpkit.engines.comm",
    "DistributedLoader": "ddpkit.data.loader", "make_loader": "ddpkit.data.loader",
    "ClusterEnv": "ddpkit.env.detect", "detect": "ddpkit.env.detect",
    "seed_everything": "ddpkit.base.seed",
}

__all__ = [
    "setup", "Runtime", "launch", "fit", "FitConfig", "CheckpointPolicy", "Hook", "Precision",
    "Checkpointer", "Accumulator", "evaluate", "unwrap", "DDPKitError", "ConfigError", "__version__",
]


def __getattr__(name: str):  # PEP 562: a name's module loads when the name is first asked for
    home = _HOME.get(name)
    if home is None:
        # a module asked for as an attribute, as when the names loaded eagerly: `ddpkit.engines`,
        # or one that moved (`ddpkit.comm`, base/moved.py)
        if not name.startswith("_"):
            try:
                return _importlib.import_module(f"ddpkit.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"ddpkit.{name}":
                    raise
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(_importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOME))


if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the table above decides
    from .base.errors import ConfigError, DDPKitError
    from .base.seed import seed_everything
    from .base.wrap import unwrap
    from .checkpoint.checkpointer import Checkpointer
    from .data.loader import DistributedLoader, make_loader
    from .engines.comm import (barrier, broadcast_object, gather_object, is_main,
                               main_process_first, print0, reduce)
    from .env.detect import ClusterEnv, detect
    from .launchers.spawn import launch
    from .training.accumulate import Accumulator
    from .training.evaluation import evaluate
    from .training.loop import CheckpointPolicy, FitConfig, Hook, fit
    from .training.precision import Precision
    from .training.runtime import Runtime, setup
