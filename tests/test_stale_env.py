"""Launcher variables left in a shell (issue 22, row 3): `RANK=0 WORLD_SIZE=2 MASTER_ADDR=...
MASTER_PORT=...` and then a plain `python script.py`.

With no launcher behind the variables the processes get a short time to meet (here 3 s through
DDPKIT_JOIN_TIMEOUT; 60 s by default), then one line names the variables and what to do; Ctrl-C
during the wait ends the process quietly with 130. Real processes throughout.
"""
import os
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import pytest

from ddpkit.env.detect import detect, spawn_env, to_environ
from ddpkit.base.errors import ConfigError
from ddpkit.launchers.network import free_port

SCRIPT = """import ddpkit, torch
rt = ddpkit.setup()
print("sum", rt.reduce(torch.ones(1) * (rt.rank + 1)).item(), flush=True)
"""
ADVICE = ("unset them (unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT) "
          "to run on one process, or launch with ddpkit run --nproc 2 {script} "
          "(DDPKIT_JOIN_TIMEOUT=SECONDS waits longer for processes that start late)")


def _stale(rank, port, wait):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "SLURM"))}
    env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               DDPKIT_JOIN_TIMEOUT=str(wait))
    env.pop("LOCAL_RANK", None)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env


def _start(tmp_path, rank, port, wait=3):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.Popen([sys.executable, "train.py"], cwd=tmp_path,
                            env=_stale(rank, port, wait), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _listening(port, proc, timeout=60.0):
    """Wait until something accepts connections on ``port`` (rank 0's store is up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("rank, what", [
    (0, "1 of 2 processes joined within 3 s"),
    (1, "no rank 0 answered at 127.0.0.1:{port} within 3 s"),
])
def test_stale_variables_end_with_one_line_after_the_short_wait(tmp_path, rank, what):
    port = free_port()
    proc = _start(tmp_path, rank, port)
    if rank == 0:  # the wait begins when its store is up, after Python and torch have loaded
        assert _listening(port, proc)
    out, err = proc.communicate(timeout=60)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    assert proc.returncode == 2 and out == ""
    assert err.splitlines() == [
        f"{prefix}error: RANK={rank} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port} say "
        f"this is rank {rank} of a job of 2, but {what.format(port=port)}: "
        + ADVICE.format(script="train.py")]
    # the line names the 3 s wait as what ended it; the 600 s collective timeout would have
    # outlasted communicate's 60 s (rank 1: from its start, imports included)


@pytest.mark.slow
def test_ctrl_c_during_the_wait_ends_quietly_with_130(tmp_path):
    port = free_port()
    proc = _start(tmp_path, 0, port, wait=60)
    assert _listening(port, proc), proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    # the Ctrl-C ended the wait (130, nothing said); the 60 s wait running out would say its
    # line and exit 2, and only after communicate's 30 s
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err == "" and out == ""


@pytest.mark.slow
def test_two_hand_started_processes_still_make_a_job(tmp_path):
    """The same variables set on purpose: both processes come, and the job runs."""
    port = free_port()
    first = _start(tmp_path, 1, port, wait=60)  # rank 1 first: it waits for rank 0 to come
    second = _start(tmp_path, 0, port, wait=60)
    for proc in (first, second):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out == "sum 3.0\n"


@pytest.mark.parametrize("extra, vouched", [
    ({}, False),
    ({"TORCHELASTIC_RUN_ID": "none"}, True),  # torchrun, ddpkit run, torch.distributed.launch
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, True),  # PyTorchJob pods start minutes apart
])
def test_only_variables_no_launcher_vouches_for_get_the_short_wait(extra, vouched):
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", **extra}
    assert detect(environ).vouched is vouched
    assert detect(to_environ(spawn_env(1, 2, master_port=1))).vouched  # ddpkit.launch


def test_the_join_timeout_is_read_and_checked():
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert detect(dict(environ, DDPKIT_JOIN_TIMEOUT="2.5")).join_timeout == 2.5
    assert detect(environ).join_timeout is None
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ConfigError, match="DDPKIT_JOIN_TIMEOUT=.* must be a number of seconds"):
            detect(dict(environ, DDPKIT_JOIN_TIMEOUT=bad))


def test_stale_rank_and_world_size_without_a_master_are_named_too():
    from ddpkit.env.dist import resolve_init_method

    cli = os.path.join("site-packages", "ddpkit", "__main__.py")  # `python -m ddpkit train`
    with pytest.raises(ConfigError) as exc, mock.patch.object(sys, "argv", [cli]):
        resolve_init_method(detect({"RANK": "1", "WORLD_SIZE": "2"}))
    assert str(exc.value) == (
        "RANK=1 WORLD_SIZE=2 say this is rank 1 of a job of 2, but no MASTER_ADDR/MASTER_PORT "
        "says where they meet: unset them (unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE "
        "MASTER_ADDR MASTER_PORT) to run on one process, or launch with ddpkit run --nproc 2 "
        "script.py (the built-in job: ddpkit train --nproc 2)")
