"""Launchers: how processes start. ``ddpkit run`` over torchrun's elastic agent
(:mod:`.torchrun`), a function on N local processes (:mod:`.spawn`), ``horovodrun``
(:mod:`.horovodrun`), addresses and routes for several nodes (:mod:`.network`), watchdogs around
the agent (:mod:`.watchdog`), the node's room for its workers (:mod:`.capacity`) and sbatch
scripts for Slurm (:mod:`.sbatch`).

Example::

    from ddpkit.launchers import RunConfig, run
    run(RunConfig("train.py", ["--epochs", "2"], nproc=2))
"""
from .spawn import LaunchError, launch
from .torchrun import RunConfig, run

__all__ = ["launch", "LaunchError", "RunConfig", "run"]
