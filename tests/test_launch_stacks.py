"""ddpkit.launchers.stacks: a node's launcher reads the stack of its own stopped worker when a
rank on another node asks (the report of a rank stopped alone on its node); real processes,
real py-spy, the job's store on loopback."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ddpkit.faults import stall
from ddpkit.launchers import watchdog
from ddpkit.launchers.stacks import StackAnswers, worker_environments

STOPPED = """import os, signal
def stop_here():
    os.kill(os.getpid(), signal.SIGSTOP)
print("ready", flush=True)
stop_here()
"""


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
        watch = dist.PrefixStore(stall.store_prefix(env), store)
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
