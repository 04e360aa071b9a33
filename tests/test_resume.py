"""Exact resume and fault tolerance: interrupted runs end bitwise equal to uninterrupted ones.

The ledger (resume_script.Ledger) records every batch's sample indices per rank and attempt, so we
can also prove that no sample is lost or repeated across a crash.
"""
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest
import torch

import ddpkit
import forkrun
import resume_script
from ddpkit.checkpoint.files import find_latest, save_checkpoint

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))


def effective_samples(out):
    """Per epoch, the indices that count: each round's batches up to where the next one resumed.

    A round is one start of the workers: its ledgers (one a rank) share an attempt number and
    a world size; rounds are taken in the order they began. Two rounds can share an attempt
    number (multinode_script numbers them by the step they resumed from): a 3-process round
    killed before its next checkpoint, and the 2-process round that redoes its steps."""
    rounds = {}
    for path in glob.glob(os.path.join(out, "ledger-r*-a*-w*.jsonl")):
        attempt, world = re.search(r"-a(\d+)-w(\d+)\.jsonl$", path).groups()
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        rounds.setdefault((int(attempt), int(world)), []).append(lines)
    order = sorted(rounds, key=lambda key: min(lines[0]["t"] for lines in rounds[key]))
    per_epoch = {}
    for i, key in enumerate(order):
        limit = tuple(rounds[order[i + 1]][0][0]["start"]) if i + 1 < len(order) else None
        for lines in rounds[key]:
            for rec in lines[1:]:
                if limit is not None and (rec["epoch"], rec["pos"]) > limit:
                    continue  # redone by the next round
                per_epoch.setdefault(rec["epoch"], []).extend(rec["idx"])
    return per_epoch


def assert_every_sample_once(out, epochs):
    per_epoch = effective_samples(out)
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, idx in per_epoch.items():
        assert sorted(idx) == list(range(resume_script.SAMPLES)), f"epoch {epoch}: lost or repeated"


def test_the_ledger_counts_each_round_up_to_where_the_next_began(tmp_path):
    # a CI run of the multi-node shrink-and-grow: the 3-node round (resumed from step 0) was
    # killed after 2 steps, before its checkpoint, and the 2-node round redid them from step
    # 0; grouped by attempt number alone both rounds counted ("epoch 0: lost or repeated")
    def ledger(rank, world, t, start, batches):
        with open(tmp_path / f"ledger-r{rank}-a0-w{world}.jsonl", "w") as f:
            f.write(json.dumps({"start": start, "t": t}) + "\n")
            for pos, idx in batches:
                f.write(json.dumps({"epoch": 0, "pos": pos, "idx": idx}) + "\n")
    for rank in range(3):  # 2 steps of 6 samples, 2 a rank
        ledger(rank, 3, 10.0 + rank / 10, [0, 0], [(6, [2 * rank, 2 * rank + 1]),
                                                  (12, [6 + 2 * rank, 7 + 2 * rank])])
    for rank in range(2):  # the same 12 samples again, 3 a rank, and 6 more
        ledger(rank, 2, 20.0, [0, 0], [(6, list(range(3 * rank, 3 * rank + 3))),
                                       (12, list(range(6 + 3 * rank, 9 + 3 * rank))),
                                       (18, list(range(12 + 3 * rank, 15 + 3 * rank)))])
    assert sorted(effective_samples(str(tmp_path))[0]) == list(range(18))


def assert_bitwise_equal(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), "parameters differ"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    result = ddpkit.launch(resume_script.train, 2, str(out), timeout=180)
    assert result["step"] == 3 * resume_script.SAMPLES // 8
    assert_every_sample_once(str(out), 3)
    return result


def test_stop_and_resume_mid_epoch_is_bitwise_exact(tmp_path, reference):
    first = ddpkit.launch(resume_script.train, 2, str(tmp_path), 3, 8, None, 17, -1, -1, 0,
                          timeout=180)
    assert first["step"] == 17  # stopped mid-epoch 2; last checkpoint at step 16
    resumed = ddpkit.launch(resume_script.train, 2, str(tmp_path), 3, 8, "auto", None, -1, -1, 1,
                            timeout=180)
    assert resumed["step"] == reference["step"]
    assert_bitwise_equal(resumed["params"], reference["params"])
    assert_every_sample_once(str(tmp_path), 3)


def test_resume_on_a_different_world_size_loses_and_repeats_nothing(tmp_path):
    ddpkit.launch(resume_script.train, 2, str(tmp_path), 2, 8, None, 5, -1, -1, 0, timeout=180)
    # saved at step 4 by 2 processes (32 samples of epoch 0 done), resumed on 1 process
    resumed = ddpkit.launch(resume_script.train, 1, str(tmp_path), 2, 8, "auto", None, -1, -1, 1,
                            timeout=180)
    assert resumed["step"] == 4 + (96 - 32) // 8 + 96 // 8
    assert_every_sample_once(str(tmp_path), 2)


def _run_with_restarts(out, kill_rank, kill_step, sig="SIGKILL", restarts=2):
    # the launcher forked (tests/forkrun.py); the signal is the script's own, to its rank
    return forkrun.ddpkit("run", "--nproc", "2", "--max-restarts", str(restarts),
                          os.path.join(HERE, "resume_script.py"), "--out", str(out),
                          "--kill-rank", str(kill_rank), "--kill-step", str(kill_step),
                          "--signal", sig, timeout=300)


@pytest.mark.parametrize("trial", range(2))
def test_kill_9_a_random_rank_at_a_random_step_and_the_run_finishes_as_if_nothing_happened(
        tmp_path, reference, trial):
    rng = random.Random(1000 + trial)  # seeds recorded: a failure names its trial
    kill_rank, kill_step = rng.randrange(2), rng.randrange(1, 36)
    res = _run_with_restarts(tmp_path, kill_rank, kill_step)
    assert res.returncode == 0, f"trial {trial} (rank {kill_rank}, step {kill_step}):\n{res.stderr[-3000:]}"
    attempts = {p.rsplit("-a", 1)[1][0] for p in glob.glob(str(tmp_path / "ledger-*"))}
    assert attempts == {"0", "1"}, "the killed group was not restarted exactly once"
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["step"] == reference["step"]
    assert_bitwise_equal(final["params"], reference["params"])
    assert_every_sample_once(str(tmp_path), 3)


WRITER = """
import sys, time, torch
from ddpkit.checkpoint.files import save_checkpoint
save_checkpoint({"w": torch.ones(4)}, sys.argv[1], step=1)
print("first saved", flush=True)
def held_save(obj, f):  # the second save stops half way through its file until it is killed
    f.write(b"half a checkpoint")
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
torch.save = held_save
save_checkpoint({"w": torch.randn(1000)}, sys.argv[1], step=2)
"""


def test_writer_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "first saved"
    assert proc.stdout.readline().strip() == "writing"  # killed inside the write, not near it
    assert glob.glob(str(tmp_path / "*.tmp"))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    found = find_latest(tmp_path)
    assert found is not None
    path, state = found
    assert path.name == "ckpt-000000001.pt" and torch.equal(state["w"], torch.ones(4))
def test_a_run_says_once_that_its_grace_period_is_too_short(tmp_path):
    """The first timed save measures a step and the save: a window shorter than a stop needs is
    one warning line, once, and the run goes on to the end."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0.001"}
    res = subprocess.run([sys.executable, os.path.join(HERE, "resume_script.py"),
                          "--out", str(tmp_path), "--epochs", "1"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    warned = [line for line in (res.stdout + res.stderr).splitlines()
              if "but the launcher kills the workers 0.001 s after it" in line]
    assert len(warned) == 1, res.stdout + res.stderr
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "600"
    (tmp_path / "long").mkdir()
    res = subprocess.run([sys.executable, os.path.join(HERE, "resume_script.py"),
                          "--out", str(tmp_path / "long"), "--epochs", "1"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "launcher kills" not in res.stdout + res.stderr
