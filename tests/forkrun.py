"""``python -m ddpkit ARGS`` for tests that read what a command does, not how it starts: forked
from this pytest process's fork server (:class:`ddpkit.launchers.forked.Forked`), which imported
torch once for all of them, where a fresh ``python`` imports it again (2.5 s of CPU each here).

The command runs as from a shell: its own session, no standard input, the given environment
whole, both streams captured. Launcher, signal and crash proofs keep real ``subprocess`` runs
(they prove how a fresh interpreter starts and dies); everything else uses :func:`ddpkit`.
"""
import os
import subprocess

from ddpkit.launchers.forked import Forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def ddpkit(*args, cwd=ROOT, timeout=240, env=None, clean=True):
    """``python -m ddpkit ARGS`` in ``cwd``; the CompletedProcess (text, both streams), as
    ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` returns it.
    ``env`` is added to this process's environment (without a launcher's variables where
    ``clean``)."""
    return python("-m", "ddpkit", *args, cwd=cwd, timeout=timeout, env=env, clean=clean)


def python(*argv, cwd=ROOT, timeout=240, env=None, clean=True):
    """``python ARGV`` (a script or ``-m MODULE`` and its arguments), forked; as :func:`ddpkit`."""
    whole = {k: v for k, v in os.environ.items() if not (clean and k in LAUNCH_VARS)}
    whole.update(env or {})
    proc = Forked([str(a) for a in argv], env=whole, cwd=str(cwd))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
