"""Issue 22, row 2: one `ddpkit train` per run directory. A second run with the same --output
stops in one line naming the run that holds it (host, pid) and writes nothing there; a lock left
by a run that is gone is taken over with one line; only one process per job takes the lock."""
import json
import os
import socket
import subprocess
import sys

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.job.rundir import LOCK_NAME, hold_run_dir
from ddpkit.job.start import _holds_lock
from ddpkit.launchers.torchrun import RunConfig

import forkrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = ("import sys\nfrom ddpkit.job.rundir import hold_run_dir\n"
        "with hold_run_dir(sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.read()\n")


def _ddpkit(*args, timeout=120):
    return forkrun.ddpkit(*args, timeout=timeout)


def _lock_file(directory, host, pid):
    (directory / LOCK_NAME).write_text(json.dumps({"host": host, "pid": pid,
                                                   "since": "2026-01-01 00:00:00"}) + "\n")


def _no_such_pid():
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1  # above the largest pid the kernel hands out


@pytest.mark.slow
def test_a_second_run_on_a_held_directory_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"first": "run"}\n')  # what the first run wrote
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"  # waits for the lock, not for a time
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        res = _ddpkit("train", "--nproc", "2", "--epochs", "1", "--output", str(out))
        after = {p.name: p.read_bytes() for p in out.iterdir()}
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.splitlines() == [
        f"error: --output {out} is in use by another `ddpkit train` (host {socket.gethostname()}, "
        f"pid {holder.pid}, since {json.loads(before[LOCK_NAME])['since']}): wait for it to end, "
        "or give this run another --output"]
    assert after == before  # nothing written, the holder's lock kept
    assert holder.returncode == 0 and not (out / LOCK_NAME).exists()  # released at its exit


@pytest.mark.slow
def test_a_lock_left_by_a_run_that_is_gone_is_taken_over_with_one_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    dead = _no_such_pid()
    _lock_file(out, socket.gethostname(), dead)
    res = _ddpkit("train", "--nproc", "1", "--epochs", "1", "--max-steps", "2", "--output",
                  str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.splitlines() == [
        f"warning: taking over the lock of {out} from pid {dead} on this host (since "
        "2026-01-01 00:00:00), which is no longer running"]
    assert (out / "config.json").is_file() and not (out / LOCK_NAME).exists()


def test_a_lock_file_nobody_holds_is_taken_over_and_removed_at_the_end(tmp_path, capsys):
    _lock_file(tmp_path, socket.gethostname(), os.getppid())  # a live pid, reused: no flock
    with hold_run_dir(str(tmp_path)):
        mine = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (mine["host"], mine["pid"]) == (socket.gethostname(), os.getpid())
    assert "which no longer holds it" in capsys.readouterr().err
    assert not (tmp_path / LOCK_NAME).exists()
    with hold_run_dir(str(tmp_path)):  # free again: taken without a word
        pass
    assert capsys.readouterr().err == ""


def test_a_lock_from_another_host_is_refused_with_what_to_do(tmp_path):
    _lock_file(tmp_path, "node7", 4242)
    with pytest.raises(ConfigError, match=rf"^--output {tmp_path} is locked by a `ddpkit train` "
                                          r"on another host \(host node7, pid 4242, since "
                                          r".*\), which this host cannot check: if that run has "
                                          rf"ended, delete {tmp_path}/{LOCK_NAME} and start"):
        with hold_run_dir(str(tmp_path)):
            pass
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node7"  # left as it was


def test_a_held_lock_refuses_even_in_the_same_process(tmp_path):
    with hold_run_dir(str(tmp_path)):
        with pytest.raises(ConfigError, match=rf"pid {os.getpid()}, since"):
            with hold_run_dir(str(tmp_path)):
                pass
        assert (tmp_path / LOCK_NAME).exists()  # the refusal did not remove the holder's lock
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        with hold_run_dir(str(a_file)):
            pass


@pytest.mark.parametrize("launch, inside, env, expected", [
    (RunConfig("w"), False, {}, True),                                    # one node: the launcher
    (RunConfig("w"), True, {"RANK": "0"}, True),                          # workers of a torchrun
    (RunConfig("w"), True, {"RANK": "1"}, False),
    (RunConfig("w", nnodes=2, node_rank=0, master_addr="h"), False, {}, True),
    (RunConfig("w", nnodes=2, node_rank=1, master_addr="h"), False, {}, False),
    (RunConfig("w", nnodes=2, rdzv_endpoint="h:1"), False, {}, False),   # nobody knows who is first
    (RunConfig("w", nnodes=2, rdzv_endpoint="h:1"), False,
     {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}, True),                  # srun: task 0
    (RunConfig("w", nnodes=2, rdzv_endpoint="h:1"), False,
     {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}, False),
])
def test_exactly_one_process_of_a_job_takes_the_lock(launch, inside, env, expected):
    assert _holds_lock(launch, inside, env) is expected
