"""Tests for ddpkit.faults.hangs: the step a hang report names, counted from a script's own optimizers."""
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import pytest
import torch
import torch.distributed as tdist

import forkrun
from ddpkit.faults.hangs import Heartbeat, _frames_to_show, python_stack

CLEAN = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


class CountingStore(tdist.HashStore):
    """An in-process store that counts the heartbeat records written to it."""

    def __init__(self):
        super().__init__()
        self.writes = 0

    def set(self, key, value):
        self.writes += key.startswith("ddpkit/heartbeat/")
        super().set(key, value)


@pytest.fixture
def watched():
    heartbeat = Heartbeat(CountingStore(), rank=0, world_size=1, interval=0.0)
    handle = heartbeat.watch_optimizers()
    yield heartbeat
    handle.remove()


def _sgd():
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    return torch.optim.SGD(model.parameters(), lr=0.1)


class Wrapper(torch.optim.Optimizer):
    """Steps an inner optimizer, as ZeroRedundancyOptimizer does: both run the step hooks."""

    def __init__(self, inner):
        super().__init__(inner.param_groups[0]["params"], {})
        self.inner = inner

    def step(self, closure=None):
        self.inner.step()


def test_each_optimizer_step_is_a_finished_step(watched):
    optimizer = _sgd()
    assert watched.last_step is None
    for _ in range(3):
        optimizer.step()
    assert watched.last_step == 3


def test_two_optimizers_and_a_wrapper_count_once_per_step(watched):
    generator, discriminator = _sgd(), _sgd()
    wrapper = Wrapper(_sgd())
    for _ in range(4):  # a GAN's two steps, then a wrapper that steps its inner optimizer
        generator.step()
        discriminator.step()
        wrapper.step()
    assert watched.last_step == 4


def test_an_explicit_step_sets_the_count_and_later_steps_go_on_from_it(watched):
    optimizer = _sgd()
    optimizer.step()
    watched.step(100)  # fit, or a checkpoint resumed at step 100
    assert watched.last_step == 100
    optimizer.step()
    optimizer.step()
    assert watched.last_step == 102


def test_watching_twice_keeps_one_hook_and_the_newest_progress_counts(watched):
    assert watched.watch_optimizers() is watched.watch_optimizers()
    optimizer = _sgd()
    optimizer.step()
    assert watched.last_step == 1  # counted once, not once per call
    newer = Heartbeat(None, rank=0, world_size=1)
    assert newer.watch_optimizers() is watched.watch_optimizers()
    newer.watch_optimizers()
    optimizer.step()
    assert newer.last_step == 1 and watched.last_step == 1


def test_a_removed_hook_is_registered_again():
    heartbeat = Heartbeat(None, rank=0, world_size=1)
    heartbeat.watch_optimizers().remove()
    handle = heartbeat.watch_optimizers()
    try:
        _sgd().step()
        assert heartbeat.last_step == 1
    finally:
        handle.remove()


def test_steps_are_written_at_most_once_per_interval():
    store = CountingStore()
    heartbeat = Heartbeat(store, rank=0, world_size=1, interval=60.0).started()
    handle = heartbeat.watch_optimizers()
    try:
        optimizer = _sgd()
        for _ in range(50):
            optimizer.step()
    finally:
        handle.remove()
    assert heartbeat.last_step == 50 and store.writes == 1  # started() only: within the interval


def _run_on_two(script, text):
    """``text`` written to ``script``, run by `ddpkit run --nproc 2`."""
    script.write_text(text)
    return forkrun.ddpkit("run", "--nproc", "2", str(script), timeout=120)


OWN_LOOP = """import os, signal, time, torch, ddpkit
from datetime import timedelta
rt = ddpkit.setup(timeout=timedelta(seconds=5), seed=0)
rt.heartbeat.watch_optimizers()
model = rt.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 10):
    if rt.rank == 1 and step == 4:
        os.kill(os.getpid(), signal.SIGSTOP)   # stuck after 3 finished steps
    time.sleep(1.1)   # a step slower than the heartbeat record's write interval (1 s)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.mark.slow
def test_a_hang_in_a_scripts_own_loop_names_the_last_finished_step(tmp_path):
    # ended by the script's 5 s collective timeout, which names the rank (below); the run's
    # 120 s timeout only bounds a hang
    res = _run_on_two(tmp_path / "own_loop.py", OWN_LOOP)
    assert res.returncode == 1, res.stderr
    assert "timed out after 5 s" in res.stderr, res.stderr
    stuck = [line for line in res.stderr.splitlines() if "did not arrive" in line]
    assert len(stuck) == 1 and stuck[0].startswith("  rank 1 did not arrive (pid "), res.stderr
    assert "last finished step 3)" in stuck[0], res.stderr
    assert "no step finished" not in res.stderr


PENDING = """import os, signal, time, torch, ddpkit
from datetime import timedelta
rt = ddpkit.setup(timeout=timedelta(seconds=3))
model = rt.wrap(torch.nn.BatchNorm1d(4))   # DDP broadcasts its buffers before every forward
model(torch.ones(2, 4)).sum().backward()
if rt.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)   # stuck
pending = rt.engine.start_all_reduce(torch.ones(1))   # as fit starts its loss's, not waited on
time.sleep(4)   # it times out meanwhile, and gloo closes the connection
model(torch.ones(2, 4))   # the next collective on it: 'Application timeout caused pair closure'
"""


@pytest.mark.slow
def test_a_collective_after_one_that_timed_out_is_the_same_one_line(tmp_path):
    # Seen under load in tests/test_chaos.py: the error gloo gives the next operation on a
    # connection that timed out has no figure in it, and was printed as a traceback.
    res = _run_on_two(tmp_path / "pending.py", PENDING)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: a collective timed out after 3 s ("), \
        res.stderr
    assert "Application timeout caused pair closure" in errors[0]
    assert "  rank 1 did not arrive (pid " in res.stderr, res.stderr


def _frame(name, path, short, line):
    return (name, path, short, line)


def test_a_stack_stopped_deep_in_torch_and_contextlib_is_shown_down_to_the_callers_frame():
    # The shape of a rank stopped inside DDP's forward (seen in CI): torch's frames, a
    # contextlib frame between them, then ddpkit's and the script's.
    stdlib = sysconfig.get_paths()["stdlib"]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    t = lambda rel: (os.path.join(site, rel), rel)                           # noqa: E731
    stack = [_frame("inner", *t("torch/_dynamo/external_utils.py"), 68),
             _frame("_fn", *t("torch/_dynamo/eval_frame.py"), 929),
             _frame("inner", os.path.join(stdlib, "contextlib.py"), "contextlib.py", 81),
             _frame("_run_ddp_forward", *t("torch/nn/parallel/distributed.py"), 1500),
             _frame("forward", *t("torch/nn/parallel/distributed.py"), 1680),
             _frame("_call_impl", *t("torch/nn/modules/module.py"), 1786),
             _frame("_wrapped_call_impl", *t("torch/nn/modules/module.py"), 1775),
             _frame("_train_step", *t("ddpkit/job/train.py"), 210),
             _frame("fit", *t("ddpkit/job/train.py"), 300),
             _frame("main", "/home/me/train.py", "train.py", 40),
             _frame("<module>", "/home/me/train.py", "train.py", 44)]
    frozen = [_frame("ABCMeta.__instancecheck__", "<frozen abc>", "<frozen abc>", 119),
              _frame("collate", *t("torch/utils/data/_utils/collate.py"), 202)]
    shown = _frames_to_show(frozen + stack)[len(frozen):]
    assert shown == [f"{name} ({short}:{line})" for name, _, short, line in stack[:9]]
    assert shown[-2] == "_train_step (ddpkit/job/train.py:210)"
    # a script that shares a name with a standard module is still the script's
    mine = [_frame("wait", "/home/me/contextlib.py", "contextlib.py", 3),
            _frame("main", "/home/me/train.py", "train.py", 9)]
    assert _frames_to_show(mine, frames=1) == ["wait (contextlib.py:3)", "main (train.py:9)"]


STOPPED = """import contextlib, time, torch
class Net(torch.nn.Module):
    def forward(self, x):
        with contextlib.nullcontext():
            print("in", flush=True)
            time.sleep(120)
Net()(torch.ones(1))
"""


def _wchan(pid):
    """The kernel function process ``pid`` sleeps in (``hrtimer_nanosleep`` in time.sleep)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.skipif(shutil.which("py-spy") is None and not os.access(
    os.path.join(os.path.dirname(sys.executable), "py-spy"), os.X_OK), reason="needs py-spy")
def test_the_stack_of_a_stopped_process_is_read(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STOPPED)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "in\n"
        # stop it in its sleep (line 6), not between the print and the sleep: "in" arrives
        # before the process reaches time.sleep
        deadline = time.monotonic() + 30
        while "sleep" not in _wchan(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGSTOP)
        stack = python_stack(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert stack is not None and stack[0] == "Net.forward (stuck.py:6)", stack
    assert stack[-1] == "<module> (stuck.py:7)", stack


def test_a_stack_that_cannot_be_read_says_why(monkeypatch):
    # a report once blamed a missing py-spy for a stack py-spy had failed to read
    from ddpkit.faults import hangs
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid nothing runs under any more
    stack, why = hangs.stack_or_why(gone.pid)
    assert stack is None and why.startswith("py-spy could not read its stack"), why
    monkeypatch.setattr(hangs.shutil, "which", lambda name: None)
    monkeypatch.setattr(hangs, "_next_to_python", lambda name: None)
    assert hangs.stack_or_why(gone.pid) == (None, "pip install py-spy to see its Python stack")
