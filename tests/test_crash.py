"""Tests for ddpkit.faults.crash: workers that die with their launcher, collective timeouts in one line."""
import os
import subprocess
import sys
import time

import pytest


# ----------------------------------------------------------------------------- workers die too

LAUNCHER = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""
WORKER = """import os, sys, time
from ddpkit.faults.crash import die_with_launcher
armed = die_with_launcher({"DDPKIT_LAUNCHER_PID": str(os.getppid())})
open(sys.argv[1], "w").write("armed" if armed else "no-op")
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_with_its_launcher(tmp_path):
    """Like torchrun's workers (own session): kill -9 the launcher, the worker follows."""
    log = tmp_path / "worker.out"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER, str(log)],
                                stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        while not log.exists() or not log.read_text():
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.1)
        assert log.read_text() == "armed"
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), "the worker outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        if worker is not None and _alive(worker):
            os.kill(worker, 9)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_die_with_launcher_is_a_no_op_for_other_launchers():
    from ddpkit.faults.crash import die_with_launcher

    assert not die_with_launcher({})
    # a process a worker started: its launcher runs, but is not its parent
    assert not die_with_launcher({"DDPKIT_LAUNCHER_PID": str(os.getpid())})


LATE_WORKER = """import os, sys, time
launcher = sys.argv[2]  # as ddpkit run passes its pid: set before the worker starts
while not os.path.exists(sys.argv[1]):  # still importing torch, say, when the launcher dies
    time.sleep(0.05)
from ddpkit.faults.crash import die_with_launcher
armed = die_with_launcher({"DDPKIT_LAUNCHER_PID": launcher})
open(sys.argv[1] + ".ran", "w").write(str(armed))
time.sleep(60)
"""
LATE_LAUNCHER = """import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())],
                         start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=open(sys.argv[2] + ".err", "w"))
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_worker_whose_launcher_died_before_it_armed_stops_with_one_line(tmp_path):
    """The launcher is killed while its worker is still starting up: the worker stops at
    setup instead of running the script on with nobody to stop it (a verify run past its
    timeout kept the script's output open for its 600 s sleep)."""
    gate = tmp_path / "gate"
    launcher = subprocess.Popen([sys.executable, "-c", LATE_LAUNCHER, LATE_WORKER, str(gate)],
                                stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    launcher.stdout.close()
    try:
        gate.write_text("")
        deadline = time.monotonic() + 60
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), "the worker ran on without its launcher"
        assert not os.path.exists(f"{gate}.ran")
        said = (tmp_path / "gate.err").read_text()
        assert said == f"ddpkit: this worker's launcher (pid {launcher.pid}) is gone; stopping\n"
    finally:
        if _alive(worker):
            os.kill(worker, 9)


# ----------------------------------------------------------------------------- collective timeouts

def test_a_gloo_timeout_is_one_line_naming_the_collective():
    import torch.distributed as tdist

    from ddpkit.faults.crash import collective_timeout

    gloo = RuntimeError("[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms "
                        "for recv operation to complete")
    try:  # a traceback through torch.distributed's all_reduce, called from this file
        def all_reduce(*args, **kwargs):
            raise gloo
        all_reduce.__code__ = all_reduce.__code__.replace(co_filename=tdist.distributed_c10d.__file__)
        all_reduce()
    except RuntimeError as exc:
        line = collective_timeout(exc)
    assert line.startswith("collective all_reduce timed out after 6 s (called at test_crash.py:")
    assert "gloo: Timed out waiting 6000ms for recv operation to complete): a peer rank " in line
    assert "--iface" in line and "\n" not in line
    fresh = RuntimeError(str(gloo))  # no traceback: nothing to name
    assert collective_timeout(fresh).startswith("a collective timed out after 6 s (gloo: ")


def test_an_nccl_timeout_names_the_op_and_other_errors_are_left_alone():
    from ddpkit.faults.crash import collective_timeout

    nccl = RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                        "OpType=ALLREDUCE, NumelIn=10, NumelOut=10, Timeout(ms)=600000) ran for "
                        "600012 milliseconds before timing out.")
    assert collective_timeout(nccl, None).startswith("collective allreduce timed out after 600 s")
    assert collective_timeout(ValueError("bad input"), None) is None


def test_a_gloo_connection_closed_by_its_timeout_is_a_timeout_with_the_groups_seconds():
    # Seen under load beside a SIGSTOPped rank: rank 0 waited in DDP's buffer broadcast and gloo
    # raised this for it, with no figure, once the connection had timed out; it was printed as
    # a traceback instead of the one line (tests/test_chaos.py, the stopped rank).
    from ddpkit.faults.crash import collective_timeout

    closed = RuntimeError("Application timeout caused pair closure")
    line = collective_timeout(closed, None, single_node=True, timeout_s=10.0)
    assert line.startswith("a collective timed out after 10 s (Application timeout caused pair "
                           "closure): a peer rank stopped answering: it is stuck or stopped"), line
    assert collective_timeout(closed).startswith("a collective timed out (Application timeout")


def test_a_timeout_names_the_ddpkit_function_the_script_called(monkeypatch):
    import torch
    import torch.distributed as tdist

    from ddpkit.engines import comm
    from ddpkit.faults.crash import collective_timeout
    from ddpkit.engines import torchdist

    gloo = RuntimeError("[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms "
                        "for recv operation to complete")

    def all_reduce(*args, **kwargs):
        raise gloo
    all_reduce.__code__ = all_reduce.__code__.replace(co_filename=tdist.distributed_c10d.__file__)
    # A group of two whose all_reduce times out: comm.reduce -> the engine -> torch.
    monkeypatch.setattr(torchdist.tdist, "all_reduce", all_reduce)
    monkeypatch.setattr(torchdist.TorchEngine, "_group", staticmethod(lambda: True))
    monkeypatch.setattr(torchdist.TorchEngine, "_comm_device", staticmethod(lambda: torch.device("cpu")))
    monkeypatch.setattr(torchdist.TorchEngine, "world_size", lambda self: 2)
    with pytest.raises(RuntimeError) as info:
        comm.reduce(torch.tensor([1.0]))
    line = collective_timeout(info.value, info.tb)
    assert line.startswith("collective all_reduce timed out after 6 s (called at test_crash.py:")
    assert " via ddpkit.engines.comm.reduce; gloo: Timed out waiting 6000ms" in line


def test_a_timeout_while_waiting_for_a_reduction_started_earlier_names_it():
    # fit starts its loss all-reduce without waiting and waits a little later (engines.Reduction)
    import torch

    from ddpkit.faults.crash import collective_timeout
    from ddpkit.engines.base import Reduction

    class TimedOut:
        def wait(self):
            raise RuntimeError("[/x/gloo/transport/tcp/pair.cc:598] Timed out waiting 6000ms "
                               "for recv operation to complete")

    with pytest.raises(RuntimeError) as info:
        Reduction(TimedOut(), torch.zeros(2)).tensor_result()
    line = collective_timeout(info.value, info.tb)
    assert line.startswith("collective all_reduce timed out after 6 s"), line
