"""Errors that mean "the user asked for something impossible".

The CLI prints these as one line (no traceback) from rank 0 and exits with status 2.
"""
from __future__ import annotations


class DDPKitError(Exception):
    """A user-facing error: the message says what was wrong and what to do.

    Example::

        raise DDPKitError("global batch 10 is not divisible by world size 3; use a multiple of 3")
    """


class ConfigError(DDPKitError):
    """Invalid configuration: flags, config file, environment variables.

    Example::

        raise ConfigError("--accum-steps must be >= 1, got 0")
    """


class JobSetupError(ConfigError):
    """The job itself is set up wrongly (tasks per node, nodes, node names): every task finds
    the same thing, so only the first one (rank 0, Slurm task 0) prints it.

    Example::

        raise JobSetupError("srun started 2 tasks on node1 ...; use --ntasks-per-node=1")
    """
