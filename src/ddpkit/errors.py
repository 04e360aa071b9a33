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
