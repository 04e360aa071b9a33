"""The conversions of real scripts that keep their own loop (docs/convert.md):
examples/imagenet_ddpkit.py (pytorch/examples imagenet/main.py's shape) and
examples/gpt_ddpkit.py (nanoGPT's train.py).

Each runs on 2 processes under `ddpkit run`; evaluates as many samples on 1 and 2 processes as
its plain original does; after kill -9 of one worker (`--max-restarts 1`) and after SIGTERM to
the launcher (then the same command again) it ends with weights bitwise equal to an
uninterrupted run's. The examples are not told about any of this: the tests kill and signal
them from outside.
"""
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, List

import pytest
import torch

from test_cli import ddpkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow
CLEAN = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


@dataclass
class Example:
    """A ddpkit example as these tests drive it and read its output."""

    script: str
    flags: Callable[[str], List[str]]  # the run's own directory -> its command-line flags
    checkpoints: str                   # where its checkpointer writes, under that directory
    is_eval_line: Callable[[str], bool]
    count: Callable[[str], int]        # samples (windows) counted by one evaluation line
    expected_count: int
    is_progress_line: Callable[[str], bool]


def imagenet(workers):
    # 500 images, a global batch of 32: 16 steps an epoch; saved every 5 steps, so a kill soon
    # after the first save resumes mid-epoch. 250 validation images: 125 per rank, uneven batches.
    return Example(
        "examples/imagenet_ddpkit.py",
        lambda out: ["--epochs", "3", "--workers", str(workers), "--save-every", "5", "-p", "4",
                     "--checkpoint-dir", os.path.join(out, "ckpt"),
                     "--out", os.path.join(out, "final.pt")],
        "ckpt", lambda line: line.startswith(" * Acc@1"),
        lambda line: int(line.split(" on ")[1].split()[0]), 250,
        lambda line: line.startswith("Epoch: ["))


EXAMPLES = {
    "imagenet": imagenet(workers=2),
    "imagenet-workers0": imagenet(workers=0),
    # 8 eval batches of 8 windows per split, split across the ranks; saved every 10 iterations.
    "gpt": Example(
        "examples/gpt_ddpkit.py",
        lambda out: [f"--out_dir={out}", "--init_from=resume", "--max_iters=60",
                     "--eval_interval=10", "--log_interval=2"],
        "run", lambda line: line.startswith("step "),
        lambda line: int(line.split(" over ")[1].split()[0]), 64,
        lambda line: line.startswith("iter ")),
}


#: The plain originals (the "before" of docs/convert.md's diffs), short: script and flags for a
#: directory.
PLAIN = {
    "imagenet": ("examples/imagenet_plain.py",
                 lambda out: ["--epochs", "1", "--workers", "0", "--out", os.path.join(out, "p.pt"),
                              "--checkpoint-dir", os.path.join(out, "ckpt")]),
    "gpt": ("examples/gpt_plain.py",
            lambda out: [f"--out_dir={out}", "--max_iters=10", "--eval_interval=10"]),
}


def launch(example, out):
    """`ddpkit run --nproc 2 SCRIPT FLAGS`, to its end."""
    return ddpkit("run", "--nproc", "2", example.script, *example.flags(str(out)), timeout=240)


def final_weights(out):
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def assert_bitwise_equal(ours, reference):
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), \
            f"{name} differs by {float((ours[name].float() - tensor.float()).abs().max()):.3g}"


def eval_counts(example, stdout):
    return [example.count(line) for line in stdout.splitlines() if example.is_eval_line(line)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """name -> (stdout, final weights) of an uninterrupted run on 2 processes (run when first
    asked for)."""
    runs = {}

    def get(name):
        if name not in runs:
            out = tmp_path_factory.mktemp(f"{name}-reference")
            res = launch(EXAMPLES[name], out)
            assert res.returncode == 0, res.stderr[-3000:]
            runs[name] = (res.stdout, final_weights(out))
        return runs[name]
    return get


class Background:
    """`ddpkit run` in the background, its output (both streams) read line by line."""

    def __init__(self, example, out, *launcher_flags):
        self.example, self.out = example, str(out)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", *launcher_flags,
             example.script, *example.flags(self.out)], cwd=ROOT, env=CLEAN, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines, self.seen = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _next_line(self, deadline):
        line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, "the run ended first:\n" + "".join(self.seen)[-3000:]
        self.seen.append(line)
        return line

    def wait_past_first_checkpoint(self, timeout=120):
        """Read on until a checkpoint is on disk and a progress line came after it."""
        deadline, folder = time.monotonic() + timeout, os.path.join(self.out, self.example.checkpoints)
        saved = False
        while True:
            line = self._next_line(deadline)
            if saved and self.example.is_progress_line(line):
                return
            saved = saved or (os.path.isdir(folder) and
                              any(n.endswith(".pt") for n in os.listdir(folder)))

    def worker(self, rank):
        """The pid of rank ``rank``: a child of the launcher, or of its fork server (a child
        of the launcher), with RANK=rank in its environment (DataLoader workers are the
        rank's children and inherit it: not these)."""
        parents = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        under = {pid for pid, ppid in parents.items() if ppid == self.proc.pid}
        under |= {pid for pid, ppid in parents.items() if ppid in under}
        for pid in sorted(under):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and parents.get(parents[pid]) is not None \
                    and f"RANK={rank}".encode() not in self._environ(parents[pid]):
                return pid
        raise AssertionError(f"no worker of rank {rank} under launcher {self.proc.pid}")

    @staticmethod
    def _environ(pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f.read().split(b"\0")
        except OSError:
            return []

    def finish(self, timeout=240):
        """Wait for the end: (exit status, everything printed)."""
        self.proc.wait(timeout=timeout)
        for line in iter(lambda: self.lines.get(timeout=30), None):
            self.seen.append(line)
        return self.proc.returncode, "".join(self.seen)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:  # a failed test: stop the job as a scheduler would
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.mark.parametrize("name", ["imagenet", "gpt"])
def test_evaluates_every_sample_once_on_1_and_2_processes(name, reference, tmp_path):
    example = EXAMPLES[name]
    one = subprocess.run([sys.executable, example.script, *example.flags(str(tmp_path))],
                         cwd=ROOT, env=CLEAN, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    counts_1, counts_2 = eval_counts(example, one.stdout), eval_counts(example, reference(name)[0])
    assert counts_1 == counts_2 == [example.expected_count] * len(counts_2) and counts_2
    assert "Traceback" not in one.stderr


@pytest.mark.parametrize("name", list(PLAIN))
def test_the_plain_original_runs_and_evaluates_as_many_samples(name, tmp_path):
    script, flags = PLAIN[name]
    res = subprocess.run([sys.executable, script, *flags(str(tmp_path))], cwd=ROOT, env=CLEAN,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    example = EXAMPLES[name]
    assert set(eval_counts(example, res.stdout)) == {example.expected_count}


@pytest.mark.parametrize("name", ["imagenet", "gpt"])
def test_kill_9_of_a_worker_restarts_and_ends_bitwise_equal(name, reference, tmp_path):
    example = EXAMPLES[name]
    with Background(example, tmp_path, "--max-restarts", "1") as run:
        run.wait_past_first_checkpoint()
        os.kill(run.worker(1), signal.SIGKILL)
        code, output = run.finish()
    assert code == 0, output[-3000:]
    resumed = [line for line in output.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1, output[-3000:]
    if name == "imagenet":  # killed inside the first epoch: the resume continues mid-epoch
        assert "mid-epoch" in resumed[0], resumed
    assert_bitwise_equal(final_weights(tmp_path), reference(name)[1])


# "imagenet" has 2 DataLoader workers: torchrun's agent signals each rank's whole process group,
# so they get SIGTERM too and must outlive the rank's save (they ignore it; see ddpkit.data.loader).
@pytest.mark.parametrize("name", ["imagenet-workers0", "gpt", "imagenet"])
def test_sigterm_saves_exits_143_and_the_same_command_ends_bitwise_equal(name, reference,
                                                                          tmp_path):
    example = EXAMPLES[name]
    with Background(example, tmp_path) as run:
        run.wait_past_first_checkpoint()
        run.proc.send_signal(signal.SIGTERM)
        code, output = run.finish()
    assert code == 143, output[-3000:]
    assert "stopped by SIGTERM at step" in output and "Traceback" not in output
    assert not (tmp_path / "final.pt").exists()
    again = launch(example, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr
    assert_bitwise_equal(final_weights(tmp_path), reference(name)[1])
