"""ddpkit: data-parallel PyTorch training done right.

Five lines make a plain script data-parallel under torchrun, Slurm, spawn or a single process::

    import ddpkit
    rt = ddpkit.setup(seed=0)
    model = rt.wrap(Net())
    loader = rt.loader(train_set, batch_size=256)      # global batch; set_epoch is automatic
    metrics = rt.evaluate(model, test_set)             # exact: no padding duplicates

The core a script imports lives here, one job per module (env, dist, comm, wrap, precision,
accumulate, data, evaluate, checkpoint, loop, ...); the engines in :mod:`ddpkit.engines`; the
products above it in :mod:`ddpkit.launchers`, :mod:`ddpkit.job`, :mod:`ddpkit.bench`, :mod:`ddpkit.cli`.
"""
from __future__ import annotations

import os as _os
import signal as _signal
import sys as _sys


def _quiet_interrupt(_signum, _frame):  # pragma: no cover - exercised in a subprocess
    _os._exit(130)  # the launcher prints the one line; a worker's traceback would be noise


if _sys.argv[:1] == ["-m"] and _os.environ.get("DDPKIT_LAUNCHER_PID"):
    # ddpkit's own worker (`python -m ddpkit.job.train` under `ddpkit run`): a Ctrl-C the
    # launcher forwards before setup() installs the stop handler (while torch and the job's
    # modules load) ends it quietly, not with a traceback under the launcher's line
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _quiet_interrupt)
    # it started with SIGINT blocked (launchers.watchdog.holding_early_interrupts): one that
    # came while the interpreter started is delivered now, to the quiet handler
    if hasattr(_signal, "pthread_sigmask"):
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGINT})


def _noting_interrupt(signum, frame):  # pragma: no cover - exercised in a subprocess
    _interrupts.append(signum)
    _signal.default_int_handler(signum, frame)


# torch's C extension imports numpy while it loads and clears any error that import raises: a
# Ctrl-C there was swallowed (`ddpkit train` went on to train) or left numpy half loaded (an
# ImportError traceback later). So numpy loads first, here, and a Ctrl-C is noted while the
# modules load: one lost or turned into another error on the way is still an interrupt.
_interrupts: list = []
_noting = False
if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    try:
        _signal.signal(_signal.SIGINT, _noting_interrupt)
        _noting = True
    except ValueError:  # imported outside the main thread: signals are not ours to handle there
        pass

try:
    import numpy as _numpy  # noqa: F401  (a dependency; before torch, for the reason above)

    from .accumulate import Accumulator
    from .errors import ConfigError, DDPKitError
    from .evaluate import evaluate
    from .loop import CheckpointPolicy, FitConfig, Hook, fit
    from .precision import Precision
    from .checkpoint.checkpointer import Checkpointer
    from .runtime import Runtime, setup
    from .wrap import unwrap

    # Also importable from here, as before the API was narrowed; their home (and documentation) is
    # the module named: rank utilities in ddpkit.comm (also methods of Runtime), loaders in
    # ddpkit.data.loader, the cluster environment in ddpkit.env.detect, seeding in ddpkit.seed.
    from .comm import (barrier, broadcast_object, gather_object, is_main,  # noqa: F401  isort: skip
                       main_process_first, print0, reduce)
    from .data.loader import DistributedLoader, make_loader  # noqa: F401  isort: skip
    from .env.detect import ClusterEnv, detect  # noqa: F401  isort: skip
    from .seed import seed_everything  # noqa: F401  isort: skip
    if _interrupts:  # a Ctrl-C the loading swallowed
        raise KeyboardInterrupt
except BaseException as _exc:  # Ctrl-C while torch loads (the first seconds of a command)
    if not (isinstance(_exc, KeyboardInterrupt) or (_interrupts and isinstance(_exc, Exception))):
        raise
    if _sys.argv[:1] != ["-m"] and _os.path.basename(_sys.argv[0] if _sys.argv else "") != "ddpkit":
        if isinstance(_exc, KeyboardInterrupt):
            raise  # a user's script or notebook: theirs to handle
        raise KeyboardInterrupt from _exc
    if not _os.environ.get("DDPKIT_LAUNCHER_PID"):  # a worker: its launcher says it
        _sys.stderr.write("interrupted\n")  # the `ddpkit` command: one line, not a traceback
    _os._exit(130)
finally:
    if _noting and _signal.getsignal(_signal.SIGINT) is _noting_interrupt:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)

from .version import __version__  # noqa: E402  isort: skip


def __getattr__(name: str):  # PEP 562: the products load when asked for, not with the library
    if name == "launch":  # a rank's `import ddpkit` loads no launcher (torchrun's agent among them)
        from .launchers.spawn import launch

        globals()["launch"] = launch
        return launch
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")

__all__ = [
    "setup", "Runtime", "launch", "fit", "FitConfig", "CheckpointPolicy", "Hook", "Precision",
    "Checkpointer", "Accumulator", "evaluate", "unwrap", "DDPKitError", "ConfigError", "__version__",
]
