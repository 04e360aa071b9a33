"""A stuck rank named within seconds with default settings (ddpkit.faults.stall), and no false
alarm for work that keeps the others waiting: real 2-process jobs of tests/stall_script.py under
`ddpkit run`, each line timed against the moment the fault began."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as tdist

from ddpkit.faults import launcher_watch, stall
from ddpkit.faults.hangs import Heartbeat

HERE = os.path.dirname(os.path.abspath(__file__))
CLEAN = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                      stall.AFTER_VAR, stall.STRAGGLER_VAR)}


def run_job(tmp_path, fault, rank=1, flags=(), env=None, timeout_s=15, script_args=(),
            on_line=lambda proc, line: None):
    """Run the job; return (exit code, [(seconds since the fault began, line)], all text)."""
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", "--timeout", str(timeout_s),
           *flags, os.path.join(HERE, "stall_script.py"), "--fault", fault, "--rank", str(rank),
           "--out", str(tmp_path), *script_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**CLEAN, **(env or {})}, cwd=str(tmp_path))
    lines = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
            on_line(proc, line)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        code = proc.wait(timeout=150)
    finally:
        proc.kill()
        reader.join()
    began = next((float(line.split()[-1]) for _, line in lines if line.startswith("fault at")),
                 None)
    assert began is not None, "\n".join(line for _, line in lines)
    return code, [(t - began, line) for t, line in lines], "\n".join(l for _, l in lines)


@pytest.mark.slow
@pytest.mark.parametrize("fault,how", [("loop", "its Python stack has not moved"),
                                       ("lock", "its Python stack has not moved"),
                                       ("read", "its Python stack has not moved"),
                                       ("stop", "its process is stopped")])
def test_a_stuck_rank_is_named_with_its_stack_within_10_s(tmp_path, fault, how):
    code, timed, text = run_job(tmp_path, fault)
    named = [(t, line) for t, line in timed if line.startswith("ddpkit: rank") and " is stuck: " in line]
    assert len(named) == 1, text           # once, not once a second
    seconds, line = named[0]
    # the watch named it once rank 0 had waited its 5 s (the default --stall-after; the line's
    # "waited N s" is the ranks' own clock), before the collective timeout ended the job (below)
    waited = int(re.search(r" waited (\d+) s for it", line).group(1))
    assert stall.DEFAULT_AFTER <= waited < 2 * stall.DEFAULT_AFTER, line
    assert line.startswith("ddpkit: rank 1 (pid ") and f" on {os.uname().nodename}," in line
    assert how in line and "rank 0 (at step 30)" in line, line
    assert ("after step 30" if fault == "stop" else "last finished step 30") in line, line
    after = text.split(line, 1)[1].strip().splitlines()
    assert after[0].strip().startswith("fault (stall_script.py:"), text   # the stack, innermost
    assert "the job keeps waiting" in text
    # a report, not a verdict: the job went on waiting until its collective timeout
    ended = [t for t, line in timed if "timed out after 15 s" in line]
    assert ended and ended[0] > 14 and seconds < ended[0], text
    assert code == 1


@pytest.mark.slow
def test_a_collective_one_rank_runs_alone_is_named_as_a_mismatch_within_10_s(tmp_path):
    # rt.evaluate under `if rt.is_main:`, then a barrier: every rank waits, none is stuck;
    # before, nothing was said until the collective timeout
    code, timed, text = run_job(tmp_path, "alone", rank=0)
    named = [(t, line) for t, line in timed if "but not in the same one" in line]
    assert len(named) == 1 and " is stuck: " not in text, text
    line = named[0][1]
    # named by the watch once every rank had waited its 5 s (the line's "has waited N s", the
    # ranks' own clock), before the 15 s collective timeout, whose line comes after it
    waited = int(re.search(r"has waited (\d+) s in a collective", line).group(1))
    assert stall.DEFAULT_AFTER <= waited < 2 * stall.DEFAULT_AFTER, line
    ended = [t for t, said in timed if "timed out after 15 s" in said]
    assert ended and named[0][0] < ended[0], text
    assert "rank 0 (at step 30) in all_reduce at stall_script.py:" in line and \
        "via ddpkit.training.runtime.evaluate" in line, line
    assert "rank 1 (at step 30) in barrier at stall_script.py:" in line, line
    assert code == 1 and "timed out after 15 s" in text, text


@pytest.mark.slow
def test_a_stopped_launcher_is_named_by_its_ranks_and_the_job_goes_on_when_it_runs(tmp_path):
    # ddpkit run SIGSTOPped: it holds the job's store, so the ranks waited in silence
    launcher = []

    def stop_the_launcher_at_the_fault(proc, line):   # step 30: stopped for 9 s
        if line.startswith("fault at"):
            launcher.append(proc.pid)
            os.kill(proc.pid, signal.SIGSTOP)
            threading.Timer(9.0, os.kill, (proc.pid, signal.SIGCONT)).start()

    code, timed, text = run_job(tmp_path, "none", script_args=["--steps", "200"],
                                on_line=stop_the_launcher_at_the_fault)
    pid = launcher[0]
    lines = [line for _, line in timed]
    named = [i for i, line in enumerate(lines)
             if line.startswith(f"ddpkit: this node's launcher (ddpkit run, pid {pid} on ")]
    again = [i for i, line in enumerate(lines)
             if line.startswith(f"ddpkit: the launcher (pid {pid}) runs again, after ")]
    # named while it was still stopped: before the line that says it runs again (one stream,
    # in order; the watch says that only once it is no longer stopped)
    assert len(named) == 1 and len(again) == 1 and named[0] < again[0], text
    assert f"continue it with `kill -CONT {pid}`" in text, text
    assert code == 0 and text.count("done") == 2, text


def test_the_launcher_watch_names_a_stopped_process_once_and_its_return():
    sleeper = subprocess.Popen(["sleep", "60"])
    said = []
    watch = launcher_watch.LauncherWatch(sleeper.pid, after=5.0, write=said.append)
    try:
        watch.look(now=100.0)
        os.kill(sleeper.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5     # until the kernel shows it stopped
        while launcher_watch.stat_state(f"/proc/{sleeper.pid}/stat") != "T" \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        for t in range(101, 115):        # named once, 5 s after it was first seen stopped
            watch.look(now=float(t))
            assert len(said) == (t >= 106), (t, said)
        os.kill(sleeper.pid, signal.SIGCONT)
        time.sleep(0.1)
        watch.look(now=120.0)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert len(said) == 2, said
    assert said[0].startswith(f"ddpkit: this node's launcher (sleep, pid {sleeper.pid} on ")
    assert said[1].startswith(f"ddpkit: the launcher (pid {sleeper.pid}) runs again, after ")


def test_a_store_that_keeps_a_call_waiting_is_named_once_while_the_launcher_runs():
    waits = iter([0.0, 4.0, 10.5, 12.0, 0.0, 11.0])
    said = []
    watch = launcher_watch.LauncherWatch(os.getpid(), after=5.0, store_wait=lambda: next(waits),
                                         store_at=" (at node0:29500)", write=said.append)
    for _ in range(6):
        watch.look()
    assert len(said) == 2 and said[0].startswith(
        "ddpkit: the job's store (at node0:29500) has not answered for 10 s: the launcher that "
        "holds it (on the first node) is stopped"), said


@pytest.mark.slow
@pytest.mark.parametrize("fault,rank,args", [
    ("eval", 1, ["--seconds", "12"]),      # one rank evaluates alone in the script's own loop
    ("save", 0, ["--seconds", "3"]),       # ddpkit's checkpoint save, each fsync 3 s
    ("compile", 1, []),                    # torch.compile's first step on one rank
    ("loader", 1, ["--seconds", "12"]),    # a DataLoader whose worker starts slowly
])
def test_work_that_keeps_the_others_waiting_is_not_called_a_hang(tmp_path, fault, rank, args):
    code, timed, text = run_job(tmp_path, fault, rank=rank, script_args=args, timeout_s=60)
    assert code == 0 and text.count("done") == 2, text
    assert " is stuck: " not in text, text
    if fault in ("eval", "save", "loader"):   # the others did wait, long enough to be named otherwise
        # "in": a rank's "done" can end a line another process's stderr began without its
        # newline yet (a CI run: both "done" printed, no line equal to it)
        finished = max(t for t, line in timed if "done" in line)
        assert finished > 10, text


@pytest.mark.slow
def test_a_straggler_is_one_line_naming_it_and_never_a_hang(tmp_path):
    code, timed, text = run_job(tmp_path, "straggler", script_args=["--steps", "700"],
                                env={stall.STRAGGLER_VAR: "15"})
    assert code == 0 and " is stuck: " not in text, text
    lines = [line for _, line in timed if "straggler" in line]
    assert lines and all(line.startswith("ddpkit: rank 1 (pid ") for line in lines), text
    slower = float(lines[-1].split("straggler: ")[1].split("x slower")[0])
    assert slower >= 1.5, text


@pytest.mark.slow
def test_stall_after_0_turns_the_reports_off(tmp_path):
    code, timed, text = run_job(tmp_path, "loop", flags=["--stall-after", "0"], timeout_s=8)
    assert code == 1 and " is stuck: " not in text and "timed out after 8 s" in text, text


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_a_bad_stall_after_is_one_line(value):
    res = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--stall-after", value,
                          "x.py"], capture_output=True, text=True, env=CLEAN, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"error: --stall-after must be a number of seconds >= 0 (0: off), got {float(value):g}"]


# ---- the rules, on records written by hand ------------------------------------------------

class Job:
    """Records of a job's ranks in one store, read by rank 0's watch."""

    def __init__(self, world=3):
        self.store = tdist.HashStore()
        self.world = world
        self.reports = []
        beat = Heartbeat(None, rank=0, world_size=world)
        self.watch = stall.StallWatch(beat, self.store, after=5.0, write=self.reports.append,
                                      stack_of=lambda pid: [f"stopped_here (pid {pid})"])

    def record(self, rank, state="running", still=0.0, age=0.0, host=None, **more):
        rec = {"host": host or self.watch.host, "pid": 100 + rank, "step": 7, "state": state,
               "still": still, "phase": None, "phase_for": 0.0, "wait_share": 0.0,
               "step_s": 0.01, "first": False, "time": time.time() - age,
               "stack": [f"where_{rank} (x.py:{rank})"], **more}
        self.store.set(f"ddpkit/watch/{rank}", json.dumps(rec))


def test_the_lowest_waiting_rank_names_a_still_rank_once():
    job = Job()
    job.record(0, "waiting", still=6)
    job.record(1, "waiting", still=6)
    job.record(2, "running", still=6)
    job.watch._look_for_stuck(6.0)
    job.watch._look_for_stuck(7.0)     # the same stall: said once
    assert len(job.reports) == 1
    first = job.reports[0].splitlines()
    assert first[0].startswith("ddpkit: rank 2 (pid 102 on ") and "ranks 0, 1 (at step 7)" \
        in first[0]
    assert first[1] == "    where_2 (x.py:2)"


def test_a_rank_that_moves_or_has_not_waited_long_is_not_named():
    job = Job(2)
    job.record(0, "waiting", still=6)
    job.record(1, "running", still=2)     # its stack moved 2 s ago: working
    job.watch._look_for_stuck(6.0)
    assert job.reports == []


def test_a_save_an_evaluation_a_dataloader_a_first_step_and_a_computation_get_a_minute():
    for more in ({"phase": "checkpoint save", "phase_for": 30.0}, {"state": "loading"},
                 {"first": True}, {"state": "computing"}):
        job = Job(2)
        job.record(0, "waiting", still=30)
        job.record(1, **{"state": "running", "still": 30, **more})
        job.watch._look_for_stuck(30.0)
        assert job.reports == [], more
        job.record(1, **{"state": "running", "still": 61, **more})
        job.watch._look_for_stuck(61.0)
        assert len(job.reports) == 1, more


def test_a_long_call_into_torch_is_computing_and_a_python_loop_is_running():
    # a 30-minute run beside a loaded machine once named a rank whose one convolution took 4
    # typical steps: its stack was still inside torch, its thread running
    from ddpkit.faults.looks import Look
    conv = torch.nn.Conv2d(32, 32, 3, padding=1)
    x = torch.randn(16, 32, 128, 128)
    done = threading.Event()

    def forwards():
        with torch.no_grad():
            while not done.is_set():
                conv(x)

    def python_loop():
        n = 0
        while not done.is_set():
            n = (n + 1) % 7

    for target, expected in ((forwards, "computing"), (python_loop, "running")):
        done.clear()
        thread = threading.Thread(target=target)
        thread.start()
        look, seen = Look(thread.ident, thread.native_id), set()
        deadline = time.monotonic() + 20
        while expected not in seen and time.monotonic() < deadline:
            look.take()
            seen.add(look.state)
            time.sleep(0.01)
        done.set()
        thread.join()
        assert expected in seen and "waiting" not in seen, (target.__name__, seen)
        assert target is forwards or "computing" not in seen


def test_a_silent_rank_is_stopped_and_its_stack_read_on_its_host():
    job = Job(2)
    job.record(0, "waiting", still=6)
    job.record(1, "running", age=4)          # no record for 4 s: not running
    job.watch._look_for_stuck(6.0)
    assert "no word from it for 4 s (its process is stopped" in job.reports[0]
    assert "    stopped_here (pid 101)" in job.reports[0]


def test_a_silent_rank_on_another_host_is_read_by_a_rank_there():
    job = Job(3)
    job.record(0, "waiting", still=6)
    job.record(1, "waiting", still=6, host="node-b")
    job.record(2, "running", age=4, host="node-b")
    helper_beat = Heartbeat(None, rank=1, world_size=3)
    helper = stall.StallWatch(helper_beat, job.store, stack_of=lambda pid: [f"read_on_b ({pid})"])
    helper.host = "node-b"
    answering = threading.Thread(target=lambda: [time.sleep(0.3), helper._answer_stack_asks()])
    answering.start()
    job.watch._look_for_stuck(6.0)
    answering.join()
    assert "    read_on_b (102)" in job.reports[0]


def test_a_silent_rank_is_placed_after_the_step_the_others_finished_not_at_its_old_record():
    # its last record was written up to a second before it stopped: at 15 ms steps that said
    # step 1 while the others had finished step 50 (and could not have without it)
    job = Job(2)
    job.record(0, "waiting", still=6, step=50)
    job.record(1, "running", age=4, step=1)
    job.watch._look_for_stuck(6.0)
    assert job.reports[0].startswith("ddpkit: rank 1 (pid 101 on ") and ", after step 50) is " \
        "stuck" in job.reports[0] and "step 1" not in job.reports[0], job.reports


def test_every_rank_waiting_in_different_collectives_is_named_as_a_mismatch_once():
    job = Job(3)
    job.record(0, "waiting", still=6, site="all_reduce at train.py:15 via ddpkit.training.runtime.evaluate")
    for rank in (1, 2):
        job.record(rank, "waiting", still=6, site="barrier at train.py:18")
    job.watch._look_for_stuck(6.0)
    job.watch._look_for_stuck(7.0)
    assert len(job.reports) == 1, job.reports
    first, last = job.reports[0].splitlines()
    assert first.startswith("ddpkit: every rank has waited 6 s in a collective, but not in the "
                            "same one: rank 0 (at step 7) in all_reduce at train.py:15 via "
                            "ddpkit.training.runtime.evaluate; ranks 1, 2 (at step 7) in barrier at "
                            "train.py:18. A collective that some ranks skip"), first
    assert last.startswith("ddpkit: the job keeps waiting")


def test_ranks_waiting_in_the_same_collective_or_not_all_waiting_are_no_mismatch():
    same = Job(2)      # the same collective at the same step: a slow transfer, not a mismatch
    for rank in (0, 1):
        same.record(rank, "waiting", still=6, site="all_reduce at train.py:9")
    same.watch._look_for_stuck(6.0)
    apart = Job(2)     # the same line at different steps: called a different number of times
    apart.record(0, "waiting", still=6, site="all_reduce at train.py:9", step=8)
    apart.record(1, "waiting", still=6, site="all_reduce at train.py:9", step=7)
    apart.watch._look_for_stuck(6.0)
    assert same.reports == [] and len(apart.reports) == 1 and "rank 0 (at step 8)" in \
        apart.reports[0]
    from ddpkit.faults.mismatch import mismatch_report
    assert mismatch_report({0: {"state": "waiting", "site": "a"}}, 2, 6.0) is None


def test_no_rank_waiting_means_no_report():
    job = Job(2)
    job.record(0, "running", still=20)
    job.record(1, "running", still=20)
    job.watch._look_for_stuck(20.0)
    assert job.reports == []


def test_the_limit_grows_with_long_steps():
    job = Job(2)
    job.watch._step_times = [3.0] * 5          # 3 s steps: 4 of them before a stall
    assert job.watch._limit() == 12.0
    assert stall.after_from_env({stall.AFTER_VAR: "2.5"}) == 2.5
    assert stall.after_from_env({stall.AFTER_VAR: "x"}) == stall.DEFAULT_AFTER
    assert stall.after_from_env({}) == stall.DEFAULT_AFTER


def test_the_watch_writes_its_record_and_stops_cleanly():
    store = tdist.HashStore()
    beat = Heartbeat(None, rank=0, world_size=2)
    beat.last_step = 3
    watch = stall.StallWatch(beat, store, interval=0.1, tick=0.02).start()
    try:
        time.sleep(1.3)   # this thread sits still in time.sleep: its stack does not move
        rec = json.loads(store.get("ddpkit/watch/0"))
    finally:
        watch.stop()
    assert not watch._thread.is_alive() and stall._CURRENT["watch"] is None
    assert rec["step"] == 3 and rec["pid"] == os.getpid() and rec["state"] == "running"
    assert rec["still"] >= 1.0 and any("test_the_watch_writes" in f for f in rec["stack"]), rec


def test_a_phase_is_recorded_and_restored_when_nested():
    with stall.phase("evaluation"):
        with stall.phase("checkpoint save"):
            assert stall._PHASE["name"] == "checkpoint save"
        assert stall._PHASE["name"] == "evaluation"
    assert stall._PHASE["name"] is None


HOLDS_THE_STORE = """import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.readline()
"""

ASKS_A_GONE_STORE = """import contextlib, subprocess, sys, torch.distributed as dist
from ddpkit.faults.nativelog import _level_flag, quiet_native_warnings
server = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
port = int(server.stdout.readline())
clients = [dist.TCPStore("127.0.0.1", port, is_master=False) for _ in range(2)]
server.kill(); server.wait()
before = _level_flag().value if _level_flag() is not None else None
with quiet_native_warnings():
    with quiet_native_warnings():   # nested, as two threads of one process may be
        pass
for quiet, client in zip((True, False), clients):  # quiet inside; loud again outside
    try:
        with quiet_native_warnings() if quiet else contextlib.nullcontext():
            client.add("k", 1)
    except dist.DistError:
        print(f"raised, quiet={quiet}", file=sys.stderr, flush=True)
print("level", before, _level_flag().value if _level_flag() is not None else None, flush=True)
"""


def test_a_store_that_is_gone_raises_without_a_native_stack_trace_while_quiet(tmp_path):
    """The stall watch and a launcher poll the job's store; when it goes with its rank, torch
    prints a C++ warning with its native stack before it raises, each try. Inside
    quiet_native_warnings it only raises; the level is restored after (nested too)."""
    script = tmp_path / "ask.py"
    script.write_text(ASKS_A_GONE_STORE)
    res = subprocess.run([sys.executable, str(script), HOLDS_THE_STORE], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    err = res.stderr
    quiet, loud = err.split("raised, quiet=True")
    assert "recvValue failed" not in quiet and "Exception raised from" not in quiet, quiet
    assert "raised, quiet=False" in loud and "recvValue failed" in loud, loud  # restored
    assert res.stdout.strip() == "level 1 1"
