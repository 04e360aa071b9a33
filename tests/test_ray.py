"""ddpkit inside Ray Train (tests/ray_script.py): a user's own loop as the
``train_loop_per_worker`` of ``TorchTrainer`` on a local Ray cluster; ``ddpkit.setup()`` adopts
Ray's group, ``rt.checkpointer`` hands each checkpoint to ``ray.train.report``, and after a worker
is killed (kill -9) Ray's ``FailureConfig`` restart resumes from Ray's checkpoint, bitwise equal
to the same script uninterrupted under ``ddpkit run``.

One Ray cluster, about a minute: `alone` (Ray's health checks time its workers; the suite's
other runs beside it would only make that noisy).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from ddpkit.checkpoint import ray_train
from ddpkit.env.detect import detect

from test_own_loop import assert_bitwise_equal, assert_every_sample_once, final, run

HERE = os.path.dirname(os.path.abspath(__file__))
# DataLoader workers, evaluation mid-training, rt.log of each step's loss and each evaluation
FLAGS = ["--workers", "2", "--eval-every", "4", "--log-to", ""]


def test_a_ray_train_worker_is_named_so_and_vouched_for():
    # what Ray Train sets in its workers before the training function: torchrun's names, and
    # the raylet's pid that every Ray process has
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500", "RAY_RAYLET_PID": "412"})
    assert (env.launcher, env.rank, env.world_size, env.vouched) == ("ray", 1, 2, True)
    assert ray_train.running(env)
    plain = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                    "TORCHELASTIC_RUN_ID": "x"})
    assert plain.launcher == "torchrun" and not ray_train.running(plain)


@pytest.mark.slow
@pytest.mark.alone
def test_a_killed_worker_is_restarted_by_ray_and_the_run_ends_bitwise(tmp_path):
    pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install "
                                            "'ray[train]'; the dev extra has it)")
    reference = tmp_path / "reference"
    run(reference, FLAGS)  # the same script, uninterrupted, under ddpkit run (forked)
    out = tmp_path / "ray"
    out.mkdir()
    session = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's sockets need a short path
    try:
        res = subprocess.run(
            [sys.executable, os.path.join(HERE, "ray_script.py"), "--out", str(out),
             "--ray-tmp", session, "--", *FLAGS, "--kill-rank", "1", "--kill-step", "7"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, cwd=str(tmp_path))
    finally:
        shutil.rmtree(session, ignore_errors=True)
    said = res.stdout + res.stderr
    assert res.returncode == 0, said[-4000:]
    result = json.loads((out / "result.json").read_text())
    # Ray kept ddpkit's checkpoints: its result names the last one, step 36 (3 epochs of 12)
    assert result["error"] is None
    assert result["checkpoint"].endswith("ddpkit-000000036"), result
    assert os.listdir(result["checkpoint"]) == ["ckpt-000000036.pt"]
    assert result["metrics"]["step"] == 36
    # the first attempt died (rank 1 killed at step 7, once Ray had checkpoint 6); the second
    # resumed from Ray's copy of it
    assert (out / "ledger-r1-a0-w2.jsonl").exists() and (out / "ledger-r1-a1-w2.jsonl").exists()
    assert (f"resumed from {out}/ray/run/ddpkit-000000006/ckpt-000000006.pt at step 6"
            in said), said[-4000:]
    ended = final(out)
    assert ended["launcher"] == "ray"
    assert_bitwise_equal(ended, final(reference))
    assert ended["evals"] == final(reference)["evals"]
    assert_every_sample_once(out)
    # rt.log's default directory under Ray: Ray's run storage, not its session directory; the
    # history there is the uninterrupted run's, record for record (the crashed attempt's
    # records after checkpoint 6 replaced, not repeated)
    assert history(out / "ray" / "run" / "log") == history(reference / "log")
    assert [r["step"] for r in history(reference / "log") if "train/loss" in r] == list(
        range(1, 37))


def history(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines]
