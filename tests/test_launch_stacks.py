"""ddpkit.launchers.stacks: a node's launcher reads the stack of its own stopped worker when a
rank on another node asks (the report of a rank stopped alone on its node); real processes,
real py-spy, the job's store on loopback."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpkit.faults import stall
from ddpkit.faults.watch_store import store_prefix, watch_store
from ddpkit.launchers import watchdog
from ddpkit.launchers.stacks import StackAnswers, worker_environments

STOPPED = """import os, signal
def stop_here():
    os.kill(os.getpid(), signal.SIGSTOP)
print("ready", flush=True)
stop_here()
"""


@pytest.mark.skipif(shutil.which("py-spy") is None and not os.access(
    os.path.join(os.path.dirname(sys.executable), "py-spy"), os.X_OK), reason="needs py-spy")
def test_a_launcher_reads_the_stack_of_its_stopped_worker_when_asked(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, RANK="2", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(store.port), TORCHELASTIC_RUN_ID="job", TORCHELASTIC_RESTART_COUNT="1")
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while watchdog.children().get(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watchdog.children().get(proc.pid) == "T"
        assert worker_environments()[proc.pid]["MASTER_PORT"] == str(store.port)
        # what the rank reporting it on another node writes: its own pid is not this
        # launcher's worker (not answered), the stopped one is
        # the worker's side: its process group's store under torchrun's agent store
        watch = watch_store(dist.PrefixStore("/worker/attempt_1", store), env)
        here = socket.gethostname()
        watch.set(stall._STACK_ASK.format(rank=1), json.dumps({"host": here, "pid": os.getpid()}))
        watch.set(stall._STACK_ASK.format(rank=2), json.dumps({"host": here, "pid": proc.pid}))
        watch.add(stall._ASKS, 2)
        with StackAnswers(interval=0.1):
            watch.wait([stall._STACK.format(rank=2)], timedelta(seconds=30))
        stack = json.loads(watch.get(stall._STACK.format(rank=2)))
        assert stack and stack[0].startswith("stop_here (stopped.py:3)"), stack
        assert not watch.check([stall._STACK.format(rank=1)])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_the_watch_keys_are_one_per_job_and_per_attempt_only_where_the_store_outlives_one():
    job = {"TORCHELASTIC_RUN_ID": "job"}
    # a fresh store each round (ddpkit run on several nodes): the nodes' counts may differ
    assert store_prefix({**job, "TORCHELASTIC_RESTART_COUNT": "1"}) == \
        store_prefix({**job, "TORCHELASTIC_RESTART_COUNT": "0"})
    shared = {**job, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert store_prefix({**shared, "TORCHELASTIC_RESTART_COUNT": "1"}) != \
        store_prefix({**shared, "TORCHELASTIC_RESTART_COUNT": "0"})


def test_a_rank_that_cannot_read_a_stack_leaves_the_answer_to_one_that_can():
    store = dist.HashStore()
    store.set(stall._STACK_ASK.format(rank=1), json.dumps({"host": "h", "pid": 42}))
    store.add(stall._ASKS, 1)
    seen = stall.answer_stack_asks(store, "h", 0, 2, lambda pid: None, skip=0)  # no ptrace right
    assert seen == 1 and not store.check([stall._STACK.format(rank=1)])
    stall.answer_stack_asks(store, "h", 0, 2, lambda pid: [f"here (pid {pid})"], mine={42})
    assert json.loads(store.get(stall._STACK.format(rank=1))) == ["here (pid 42)"]


HOSTS_THE_STORE = """import sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_launcher_whose_workers_store_goes_with_them_prints_nothing(tmp_path, capfd):
    """A restart: the rank that held the job's store ends while the launcher still polls it.
    torch's client prints its native stack trace for a store that is gone; the launcher only
    tries again later, so it says nothing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="job")
    script = tmp_path / "rank0.py"
    script.write_text(HOSTS_THE_STORE)
    proc = subprocess.Popen([sys.executable, str(script), str(port)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        mine = dist.PrefixStore(store_prefix(env),
                                dist.TCPStore("127.0.0.1", port, is_master=False))
        with StackAnswers(interval=0.05):
            deadline = time.monotonic() + 30
            while not mine.check([stall._ASKS]) and time.monotonic() < deadline:
                time.sleep(0.05)  # the launcher has found its worker and polls its store
            assert mine.check([stall._ASKS])
            del mine
            proc.kill()       # its store goes with it; left unreaped, it is still a child a
            time.sleep(1.0)   # while, as a worker is until its agent reaps it
        proc.wait()
    finally:
        proc.kill()
        proc.wait()
    err = capfd.readouterr().err
    assert "recvValue failed" not in err and "Exception raised from" not in err, err
