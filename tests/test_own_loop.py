"""A script's own loop resumes exactly (tests/own_loop_script.py): kill -9 of a random rank at a
random step, or SIGTERM (preemption), and the run ends bitwise equal to the uninterrupted one, with
augmentation drawing from the global RNGs, DataLoader workers, dropout, accumulation, uneven
shards and evaluation in the middle of training; the same under ddpkit.fit, and with FSDP.
"""
import os
import random
import subprocess
import sys

import pytest
import torch

import own_loop_script
import forkrun
from test_resume import effective_samples

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
EPOCHS = 3
CONFIGS = {  # name -> script flags
    "own-workers2-eval": ["--workers", "2", "--eval-every", "4"],
    "own-workers0-accum2": ["--workers", "0", "--accum", "2"],
    "fit-workers2": ["--fit", "--workers", "2"],
    "own-fsdp-eval": ["--engine", "fsdp", "--workers", "0", "--eval-every", "4"],
    "own-async-workers2-eval": ["--workers", "2", "--eval-every", "4", "--async-save"],
    "fit-async-accum2": ["--fit", "--workers", "0", "--accum", "2", "--async-save"],
    "own-fsdp-async-eval": ["--engine", "fsdp", "--workers", "0", "--eval-every", "4",
                            "--async-save"],
}


def run(out, flags, restarts=0, check=True):
    os.makedirs(out, exist_ok=True)
    # the launcher forked (tests/forkrun.py); the kill -9 is the script's own, of its rank
    res = forkrun.ddpkit("run", "--nproc", "2", "--max-restarts", str(restarts),
                         os.path.join(HERE, "own_loop_script.py"), "--out", str(out),
                         "--epochs", str(EPOCHS), *flags, timeout=300)
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def final(out):
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def assert_bitwise_equal(a, b):
    assert a["step"] == b["step"]
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y), f"parameters differ by {float((x - y).abs().max()):.3g}"


def assert_every_sample_once(out):
    # 91 samples on 2 ranks: DistributedSampler's rule pads one (a repeat of the epoch's first)
    per_epoch = effective_samples(str(out))
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, idx in per_epoch.items():
        assert sorted(set(idx)) == list(range(own_loop_script.SAMPLES)), f"epoch {epoch}"
        assert len(idx) == own_loop_script.SAMPLES + 1, f"epoch {epoch}: lost or repeated"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    refs = {}
    for name, flags in CONFIGS.items():
        out = tmp_path_factory.mktemp(name)
        run(out, flags)
        refs[name] = final(out)
    return refs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kill_9_at_a_random_step_resumes_bitwise(tmp_path, references, name):
    rng = random.Random(f"{name}-1")  # seeded: a failure names its rank and step
    steps = references[name]["step"]
    rank, step = rng.randrange(2), rng.randrange(1, steps)
    res = run(tmp_path, [*CONFIGS[name], "--kill-rank", str(rank), "--kill-step", str(step)],
              restarts=1, check=False)
    assert res.returncode == 0, f"rank {rank} killed at step {step}:\n{res.stderr[-3000:]}"
    # a checkpoint every 3 steps; an async one is surely complete once the next save began
    # (it waits for the write before it): a kill before that may restart from the beginning
    complete_by = 6 if "--async-save" in CONFIGS[name] else 3
    if step >= complete_by:
        assert "resumed from" in res.stdout + res.stderr
    assert_bitwise_equal(final(tmp_path), references[name])
    assert_every_sample_once(tmp_path)


def test_evaluating_mid_run_leaves_training_untouched(tmp_path, references):
    flags = [f for f in CONFIGS["own-workers2-eval"]][:2]  # the same run without evaluation
    run(tmp_path, flags)
    with_eval = references["own-workers2-eval"]
    assert len(with_eval["evals"]) == with_eval["step"] // 4
    assert_bitwise_equal(final(tmp_path), with_eval)


@pytest.mark.parametrize("sync", ["own-workers2-eval", "own-fsdp-eval"])
def test_async_saves_train_exactly_as_synchronous_ones(references, sync):
    asynchronous = "own-fsdp-async-eval" if "fsdp" in sync else "own-async-workers2-eval"
    assert_bitwise_equal(references[asynchronous], references[sync])
    assert references[asynchronous]["evals"] == references[sync]["evals"]


@pytest.mark.parametrize("flags", [[], ["--async-save"]], ids=["sync", "async"])
def test_sigterm_saves_stops_with_143_and_the_rerun_ends_bitwise(tmp_path, references, flags):
    flags = CONFIGS["own-workers0-accum2"] + flags
    res = run(tmp_path, [*flags, "--kill-rank", "1", "--kill-step", "5", "--signal", "SIGTERM"],
              check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM at step" in out and "Traceback" not in out
    assert not os.path.exists(tmp_path / "final.pt")
    again = run(tmp_path, [*flags, "--attempt", "1"])  # the same command: resumes where the stop saved
    assert "resumed from" in again.stdout + again.stderr
    assert_bitwise_equal(final(tmp_path), references["own-workers0-accum2"])
    assert_every_sample_once(tmp_path)
