"""Workers forked from a server that has imported torch once: ``ddpkit run``'s default start.

torchrun starts each worker as a fresh ``python -u script.py``, so every rank of a node imports
torch on its own (about 2.5 s of CPU each on 2 cores; on a GPU node 8 ranks at once, often from a
network file system). ``ddpkit run`` hands torchrun's agent :func:`python` instead, with
multiprocessing's ``forkserver``: one server per node imports :data:`PRELOAD` once, and each
worker is forked from it and then runs the script as ``python -u`` would have
(:func:`python`). The agent is the same (restarts, rendezvous, stop signals, failures);
``ddpkit run --start-method spawn`` keeps torchrun's fresh interpreters.

What a forked worker sees, as under ``python -u script.py``: ``sys.argv``, ``sys.path[0]`` (the
script's directory; the working directory for ``-m``), ``__name__ == "__main__"``, unbuffered
output, its own session (a terminal's Ctrl-C reaches the launcher, which forwards it once),
``atexit`` handlers and non-daemon threads run at the end, an uncaught exception printed by
``sys.excepthook`` with exit status 1, ``sys.exit(n)`` as status ``n``, an uncaught Ctrl-C as
death by SIGINT. The server imports torch but never initialises CUDA (a fork after that would
break the workers' CUDA); each worker initialises its own.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Mapping, Optional, Sequence, Tuple

from ..faults.stops import FORKED_BY_VAR

__all__ = ["python", "PRELOAD", "SHIELDED", "prepare_server", "start_server", "server_pid", "helpers",
           "START_METHODS", "Forked"]

#: The modules the server imports once for every worker it forks: torch and what every rank of
#: a ddpkit job loads (none touches CUDA at import).
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "ddpkit"]

#: ``ddpkit run --start-method``: ``forkserver`` (default; workers forked from a server that
#: imported torch once) or ``spawn`` (torchrun's own: each worker a fresh ``python -u``).
START_METHODS = ("forkserver", "spawn")



#: The signals a fork server never takes (blocked in it; its workers unblock them): a terminal's
#: Ctrl-C, Slurm's SIGTERM to every process of a step, a stop to a process group reach the
#: launcher and the workers, which stop in order; the server goes when the launcher does.
SHIELDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT",
                                                    "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


def prepare_server() -> None:
    """In the launcher, before the agent starts its first worker: what the server preloads.

    Example::

        prepare_server()   # then torchrun's agent with start_method="forkserver"
    """
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def start_server() -> Optional[int]:
    """In the launcher: start its fork server now (it imports :data:`PRELOAD` in the background
    while the launcher goes on), shielded from the stop signals (:data:`SHIELDED`); its pid.

    Example::

        server = start_server()   # 4242; the workers it forks are its children
    """
    from multiprocessing import forkserver, resource_tracker

    prepare_server()
    with _STARTING:
        if server_pid() is not None:
            forkserver.ensure_running()  # (started: restarted only if it died)
            return server_pid()
        shield = (hasattr(signal, "pthread_sigmask")
                  and threading.current_thread() is threading.main_thread())
        before = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED) if shield else None
        os.environ[_ROOM_VAR] = " " * _ROOM  # room for each worker's own (_show_environment)
        try:  # a signal mask is inherited: the tracker and the server start with the shield
            # (the tracker's own start unblocks SIGINT and SIGTERM here after it: again)
            resource_tracker.ensure_running()
            if shield:
                signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
            forkserver.ensure_running()
        finally:
            os.environ.pop(_ROOM_VAR, None)
            if before is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return server_pid()


def helpers() -> set:
    """The pids of this process's fork server and multiprocessing's resource tracker (that
    started with it), those running; not workers.

    Example::

        helpers()   # {4242, 4243}
    """
    from multiprocessing import resource_tracker

    pids = {server_pid(), getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {pid for pid in pids if pid is not None}


_STARTING = threading.Lock()
# A fork server's environment, which /proc/PID/environ of its workers shows (ps e, a test or a
# tool reading a worker's RANK), is made larger by this much so that each worker can write its
# own variables over it (_show_environment); popped from the workers' os.environ.
_ROOM_VAR, _ROOM = "DDPKIT_FORKED_ROOM", 16384


def server_pid() -> Optional[int]:
    """This process's fork server's pid (None before it started).

    Example::

        server_pid()   # 4242
    """
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def python(*argv: str) -> None:
    """Run ``python argv...`` in this (forked) process: ``-u`` and ``-m MODULE`` as Python reads
    them, then the script or module with its arguments. The entry point torchrun's agent calls
    in each worker; returns only when the script ended with status 0 (the agent's success),
    else the process exits with the script's status, as the interpreter would.

    Example::

        python("-u", "train.py", "--epochs", "2")
    """
    args = list(argv)
    module = False
    while args and args[0] in ("-u", "-m"):
        module = module or args[0] == "-m"
        args.pop(0)
    if not args:
        raise SystemExit("ddpkit run: no script to run")
    target, script_args = args[0], args[1:]
    _become_a_worker(own=module and target.startswith("ddpkit."))
    _show_command([sys.executable, *argv])
    _show_environment(os.environ)
    status = _run(target, module, script_args)
    _finish()
    if status == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if status:
        os._exit(status)


def _become_a_worker(own: bool) -> None:
    with contextlib.suppress(OSError):
        os.setsid()  # its own session, as torchrun starts a worker: DataLoader workers with it
    # `ddpkit run`'s workers die with it (ddpkit.faults.stops.die_with_launcher): here the
    # parent is the server, which exits as soon as the launcher is gone
    # multiprocessing gave this process its parent's start method (forkserver): the script's own
    # processes (DataLoader workers) start as under python, by the platform's default (fork on
    # Linux), children of this process that see it die
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    # Each child of a fork server holds the write end of the pipe that tells the server its
    # launcher is gone: closed here, so that a killed launcher ends the server, and the server
    # its workers (their parent-death signal), instead of both living on
    from multiprocessing import forkserver

    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
    for name in ("_forkserver_alive_fd", "_forkserver_address", "_forkserver_pid"):
        if hasattr(server, name):
            setattr(server, name, None)
    os.environ.pop(_ROOM_VAR, None)
    launcher = os.environ.get("DDPKIT_LAUNCHER_PID")
    if launcher:
        os.environ[FORKED_BY_VAR] = launcher
        os.environ["DDPKIT_LAUNCHER_PID"] = str(os.getppid())
    for name in ("stdout", "stderr"):  # -u: unbuffered, as torchrun's `python -u`
        stream = getattr(sys, name)
        with contextlib.suppress(Exception):
            stream.flush()
            raw = io.FileIO(stream.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding,
                                                errors=stream.errors, write_through=True))
    if own:  # ddpkit's own worker: a Ctrl-C before setup() ends it quietly (base.interrupts)
        from ..base.interrupts import _quiet_interrupt

        signal.signal(signal.SIGINT, _quiet_interrupt)
    if hasattr(signal, "pthread_sigmask"):  # the server's shield is not the script's
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)


def _show_command(argv: Sequence[str]) -> None:
    """What ``ps``, ``pkill -f`` and ``/proc/PID/cmdline`` show for this process: the command
    it runs (``python -u train.py ...``), not the fork server's; written over the server's own
    command line (which CPython copied at start and never reads again), cut to its length."""
    _write_area(44, argv, whole=False)


def _write_area(field: int, strings: Sequence[str], whole: bool) -> None:
    """Write ``strings`` NUL-separated over this process's argument (``field`` 44: stat's 48th
    and 49th, arg_start and arg_end) or environment area (46: env_start, env_end), NULs after;
    cut to fit (``whole``: only the strings that fit whole). Linux; a no-op elsewhere."""
    with contextlib.suppress(Exception):
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # fields from the third on
        start, end = int(fields[field + 1]), int(fields[field + 2])
        if not 0 < start < end:
            return
        text, room = b"", end - start - 1
        for item in (os.fsencode(s) + b"\0" for s in strings):
            if len(text) + len(item) <= room:
                text += item
            elif not whole:
                text += item[:room - len(text)]
                break
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(text + b"\0" * (end - start - len(text)))


def _show_environment(environ: Mapping[str, str]) -> None:
    """What ``/proc/PID/environ`` (``ps e``, tools finding a worker by its ``RANK``) shows for
    this process: its own variables, not those the fork server started with; written over the
    server's (:data:`_ROOM` bytes larger than they were), whole variables only, as many as fit."""
    _write_area(46, [f"{k}={v}" for k, v in environ.items()], whole=True)


def _run(target: str, module: bool, args: list) -> int:
    """The script's exit status as the interpreter reports it (-SIGINT: an uncaught Ctrl-C)."""
    try:
        if module:
            sys.argv = [target, *args]  # runpy puts the module's path in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_status(exc.code)
    except KeyboardInterrupt as exc:
        _report(exc)
        return -signal.SIGINT
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter would
        _report(exc)
        return 1


def _report(exc: BaseException) -> None:
    """``sys.excepthook`` on the traceback from the script's first frame, as ``python`` prints
    it (without runpy's frames and this module's)."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_code.co_filename.endswith("runpy.py")
                              or tb.tb_frame.f_code.co_filename == "<frozen runpy>"):
        tb = tb.tb_next
    tb = tb or exc.__traceback__
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the default prints exc's own


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter does after the main script: join non-daemon threads, run atexit
    handlers, flush."""
    shutdown: Optional[object] = getattr(threading, "_shutdown", None)
    with contextlib.suppress(Exception):
        if callable(shutdown):
            shutdown()
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class Forked:
    """``python ARGV...`` as a process forked from this process's fork server (started once,
    with :data:`PRELOAD` imported), like ``subprocess.Popen`` with its output captured: in a
    session of its own, no standard input, ``env`` as its whole environment, killed by the
    kernel if this process dies. ``ddpkit verify`` runs the user's script so, four times.

    Example::

        run = Forked(["train.py", "--epochs", "1"], env=dict(os.environ), cwd="/tmp/run")
        out, err = run.communicate(timeout=600)
        run.returncode   # 0; -9 if it was killed by SIGKILL, as Popen says it
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str],
                 cwd: Optional[str] = None, capture: bool = True) -> None:
        import multiprocessing

        context = multiprocessing.get_context("forkserver")
        start_server()
        self.args = list(argv)
        self._dir = tempfile.mkdtemp(prefix="ddpkit-forked-")
        self._out, self._err = (os.path.join(self._dir, name) for name in ("out", "err"))
        self._process = context.Process(
            target=_forked_main, name="ddpkit-forked", daemon=False,
            args=(self.args, dict(env), cwd or os.getcwd(),
                  self._out if capture else None, self._err if capture else None))
        self._process.start()
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        """The exit status (negative: killed by that signal), None while it runs."""
        return self._process.exitcode

    def communicate(self, timeout: Optional[float] = None) -> Tuple[str, str]:
        """Wait for the end (``subprocess.TimeoutExpired`` past ``timeout`` s, the process left
        running); its standard output and error."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        try:
            return tuple(_read(path) for path in (self._out, self._err))  # type: ignore
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL its session (the process, a launcher's workers, DataLoader workers)."""
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(self.pid, signal.SIGKILL)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _forked_main(argv: list, env: dict, cwd: str, out: Optional[str],
                 err: Optional[str]) -> None:
    # the fork server exits with the process that asked for this one: so does this one
    _die_with_parent()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        if path is None:  # not captured: the launcher's own output
            continue
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    python(*argv)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
