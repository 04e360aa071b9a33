"""Ctrl-C in the first seconds of a process, before a stop handler exists: while torch loads.

Two cases, both of ddpkit's own processes (a user's script gets Python's KeyboardInterrupt):

- a worker that ddpkit's launcher started with ``python -m ddpkit...`` (it runs with SIGINT
  blocked until here): :func:`quiet_worker` makes a Ctrl-C before ``setup()`` end it quietly
  (exit 130, no traceback under the launcher's one line). The package's ``__init__`` calls it.
- the ``ddpkit`` command: :func:`loading_the_command` wraps the import of its modules, so a
  Ctrl-C there prints one ``interrupted`` line and exits 130, even one that torch's loading
  swallowed (its C extension imports numpy and clears any error that import raises).

Standard library only: this runs before torch is imported.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Iterator, List

__all__ = ["quiet_worker", "loading_the_command"]


def _quiet_interrupt(_signum, _frame):  # pragma: no cover - exercised in a subprocess
    os._exit(130)  # the launcher prints the one line; a worker's traceback would be noise


def quiet_worker() -> None:
    """In ddpkit's own worker (``python -m ddpkit.job.train`` under ``ddpkit run``): a Ctrl-C the
    launcher forwards before ``setup()`` installs the stop handler ends it quietly, and a SIGINT
    the launcher held while the interpreter started is delivered now, to that handler. Elsewhere
    it does nothing.

    Example::

        quiet_worker()   # first thing at `import ddpkit`
    """
    if sys.argv[:1] != ["-m"] or not os.environ.get("DDPKIT_LAUNCHER_PID"):
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _quiet_interrupt)
    # started with SIGINT blocked (launchers.watchdog.holding_early_interrupts)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _is_the_command() -> bool:
    # `ddpkit ...` (the console script), `python -m ddpkit ...` (argv[0] is "-m" while the
    # package loads, then the path of ddpkit/__main__.py)
    first = sys.argv[0] if sys.argv else ""
    return (first == "-m" or os.path.basename(first) == "ddpkit"
            or first.endswith(os.path.join("ddpkit", "__main__.py")))


@contextlib.contextmanager
def loading_the_command() -> Iterator[None]:
    """Import the ``ddpkit`` command's modules inside this: a Ctrl-C meanwhile (torch loading,
    the first seconds of a command) is one ``interrupted`` line and exit 130. numpy loads first,
    inside it, and a Ctrl-C is noted while the modules load, so one that torch's loading swallowed
    or turned into another error is still an interrupt. Outside the command (a test importing
    ``ddpkit.cli``) the KeyboardInterrupt is raised as Python would.

    Example::

        with loading_the_command():
            from . import bench, run, train
    """
    interrupts: List[int] = []

    def noting(signum, frame):  # pragma: no cover - exercised in a subprocess
        interrupts.append(signum)
        signal.default_int_handler(signum, frame)

    noted = False
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, noting)
            noted = True
        except ValueError:  # imported outside the main thread: signals are not ours there
            pass
    try:
        import numpy  # noqa: F401  (a dependency; before torch, for the reason above)

        yield
        if interrupts:  # a Ctrl-C the loading swallowed
            raise KeyboardInterrupt
    except BaseException as exc:
        if not (isinstance(exc, KeyboardInterrupt) or (interrupts and isinstance(exc, Exception))):
            raise
        if not _is_the_command():
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise KeyboardInterrupt from exc
        if not os.environ.get("DDPKIT_LAUNCHER_PID"):  # a worker: its launcher says it
            sys.stderr.write("interrupted\n")  # the `ddpkit` command: one line, not a traceback
        os._exit(130)
    finally:
        if noted and signal.getsignal(signal.SIGINT) is noting:
            signal.signal(signal.SIGINT, signal.default_int_handler)
