"""Fault-tolerant runs (``ddpkit run --fault-tolerant``, torchft underneath): a lost replica is
restarted alone and heals from a live peer while the others keep committing steps; every sample
of an epoch is trained once (tests/live_script.py's ledgers); bad input is one line.
"""
import collections
import glob
import json
import os
import random
import signal
import time

import pytest
import torch

import forkrun
import live_script
from ddpkit.data.live import LiveLoader, epoch_order, step_share, steps_per_epoch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'ddpkit[ft]')")
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "live_script.py")
EPOCHS = 3
STEPS = steps_per_epoch(live_script.SAMPLES, live_script.BATCH)  # 12 a epoch


# ---------------------------------------------------------------- the data, without processes
def test_any_sequence_of_quorums_trains_every_sample_once():
    rng = random.Random(0)
    for samples, batch in ((91, 8), (10, 4), (5, 8), (100, 7)):
        order = epoch_order(samples, seed=1, epoch=2)
        seen = []
        for step in range(steps_per_epoch(samples, batch)):
            replicas = rng.randint(1, 5)  # whoever is alive at this step
            shares = [step_share(order, step, batch, r, replicas) for r in range(replicas)]
            weights = sum(counted for _, counted in shares)
            assert weights == len(order[step * batch:(step + 1) * batch])
            seen += [i for idx, counted in shares for i in idx[:counted]]
        assert sorted(seen) == list(range(samples))


def test_a_replica_without_samples_counts_nothing():
    assert step_share([4, 5], 0, 8, rank=2, replicas=3) == ([4], 0)
    assert step_share(list(range(8)), 0, 8, rank=0, replicas=3) == ([0, 1, 2], 3)
    assert steps_per_epoch(91, 8) == 12 and steps_per_epoch(91, 8, drop_last=True) == 11


class _FakeLive:
    """Commits what the test says; the quorum is the list the test gives."""

    def __init__(self, quorums):
        self.step, self.quorums, self.weights, self.share = 0, list(quorums), [], []

    def record_share(self, indices):
        self.share = indices

    def begin_step(self):
        return self.quorums.pop(0)

    def counted(self, samples, total):
        self.weights.append(samples / total)


def test_a_step_that_did_not_commit_is_given_again_to_the_new_quorum():
    data = torch.utils.data.TensorDataset(torch.arange(10))
    live = _FakeLive([(1, 3), (1, 2), (0, 2), (0, 1)])
    loader = LiveLoader(data, 6, live, seed=0, shuffle=False)
    batches = iter(loader)
    assert next(batches)[0].tolist() == [2, 3]          # step 0, replica 1 of 3: not committed
    assert next(batches)[0].tolist() == [3, 4, 5]       # step 0 again, replica 1 of 2
    live.step = 1                                        # committed
    assert next(batches)[0].tolist() == [6, 7]          # step 1, replica 0 of 2
    assert loader.at_last_batch and loader.state_dict()["epoch"] == 0
    live.step = 2
    assert list(batches) == []                           # the epoch is over
    assert loader.state_dict() == {"epoch": 1, "samples_done": 0, "step": 2, "seed": 0,
                                   "world_size": 1, "pad_base": 0}


# ---------------------------------------------------------------- real replicas
def run(out, *flags, nproc=3, launcher=(), timeout=240, env=None):
    os.makedirs(out, exist_ok=True)
    return forkrun.ddpkit("run", "--fault-tolerant", "--nproc", str(nproc), *launcher, SCRIPT,
                          "--out", str(out), "--epochs", str(EPOCHS), *flags, timeout=timeout,
                          env=env)


def ledgers(out):
    """{(replica, attempt): [records]}"""
    found = {}
    for path in glob.glob(os.path.join(out, "ledger-*.jsonl")):
        replica, attempt = os.path.basename(path)[7:-6].rsplit("-", 1)
        with open(path) as f:
            found[(replica, int(attempt))] = [json.loads(line) for line in f]
    return found


def assert_every_sample_once(found):
    per_step = collections.defaultdict(list)
    for records in found.values():
        for r in records:
            if "step" in r:
                per_step[r["step"]].append(r)
    assert sorted(per_step) == list(range(EPOCHS * STEPS))
    for epoch in range(EPOCHS):
        counted = [i for s in range(epoch * STEPS, (epoch + 1) * STEPS)
                   for r in per_step[s] for i in r["idx"]]
        assert sorted(counted) == list(range(live_script.SAMPLES)), f"epoch {epoch}"


def ends(found):
    return {key: records[-1] for key, records in found.items() if "end" in records[-1]}


@pytest.mark.slow
def test_a_killed_replica_is_restarted_alone_and_heals_from_a_live_peer(tmp_path):
    res = run(tmp_path, "--kill-step", "10", "--step-sleep", "0.1")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("ddpkit")]
    assert lines[0] == ("ddpkit run: replica node0-1 failed (killed by SIGKILL); restarting it "
                        "alone (restart 1 of 10): it takes a live peer's state, the others go on")
    assert lines[1] == "ddpkit: step 10 committed by 2 replica(s) (3 before)"
    assert any(line.startswith("ddpkit: replica node0-1 joined at step ") for line in lines)
    assert "Traceback" not in res.stderr
    found = ledgers(tmp_path)
    # the survivors never restarted: one attempt each, from step 0 to the end
    assert sorted(found) == [("node0-0", 0), ("node0-1", 0), ("node0-1", 1), ("node0-2", 0)]
    healed = found[("node0-1", 1)][0]["start"]
    assert healed > 10  # not from disk (there is none): from a peer, where the job was
    assert_every_sample_once(found)
    done = ends(found)
    assert len(done) == 3 and {e["end"] for e in done.values()} == {EPOCHS * STEPS}
    first = next(iter(done.values()))
    for e in done.values():  # the healed replica holds the very same model and schedule
        assert e["params"] == first["params"] and e["lr"] == first["lr"]
        assert len(e["evals"]) == len(first["evals"])


@pytest.mark.slow
def test_without_randomness_a_run_with_a_loss_ends_where_an_uninterrupted_one_does(tmp_path):
    calm = run(tmp_path / "calm", "--dropout", "0")
    lost = run(tmp_path / "lost", "--dropout", "0", "--kill-step", "7", "--step-sleep", "0.1")
    assert calm.returncode == 0 and lost.returncode == 0, lost.stderr[-3000:]
    a = next(iter(ends(ledgers(tmp_path / "calm")).values()))
    b = next(iter(ends(ledgers(tmp_path / "lost")).values()))
    assert a["lr"] == b["lr"]  # the schedule counted committed steps only
    # the same samples and the same mean gradient each step; only the summation order differs
    assert torch.allclose(torch.tensor(a["params"]), torch.tensor(b["params"]), atol=1e-5)


@pytest.mark.slow
def test_a_stopped_replica_is_left_behind_then_heals_when_continued(tmp_path):
    out = tmp_path
    os.makedirs(out, exist_ok=True)
    from ddpkit.launchers.forked import Forked

    proc = Forked(["-m", "ddpkit", "run", "--fault-tolerant", "--nproc", "3", "--timeout", "3",
                   SCRIPT, "--out", str(out), "--epochs", str(EPOCHS), "--stop-step", "5",
                   "--step-sleep", "0.15"], env=dict(os.environ), cwd=str(out))
    try:
        pid = _wait_for_stopped(out, "node0-1")
        stopped = time.monotonic()
        _wait_for_step(out, "node0-0", 15)  # the others went on without it
        time.sleep(max(0.0, stopped + 4.0 - time.monotonic()))  # said after 3 s
        os.kill(pid, signal.SIGCONT)  # a whole epoch behind by now
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "replica node0-1 has been stopped" in err
    found = ledgers(out)
    assert sorted(found) == [("node0-0", 0), ("node0-1", 0), ("node0-2", 0)]  # no restart
    assert_every_sample_once(found)
    done = ends(found)
    assert len({json.dumps(e["params"]) for e in done.values()}) == 1


def _wait_for_stopped(out, replica, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = os.path.join(out, f"ledger-{replica}-0.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                pid = json.loads(f.readline())["pid"]
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return pid
        time.sleep(0.1)
    raise AssertionError(f"{replica} never stopped itself")


def _wait_for_step(out, replica, step, timeout=60):
    deadline = time.monotonic() + timeout
    path = os.path.join(out, f"ledger-{replica}-0.jsonl")
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                steps = [json.loads(line).get("step", -1) for line in f if line.endswith("\n")]
            if steps and max(steps) >= step:
                return
        time.sleep(0.1)
    raise AssertionError(f"{replica} never reached step {step} without the stopped one")


@pytest.mark.slow
def test_a_script_that_raises_every_time_stops_every_replica_with_one_line(tmp_path):
    res = run(tmp_path, "--raise-step", "4", "--step-sleep", "0.1")
    assert res.returncode == 1
    said = [line for line in res.stderr.splitlines() if line.startswith("ddpkit run:")]
    assert said[-1] == ("ddpkit run: replica node0-1 failed twice in a row (exit code 1; its "
                        "error is above): stopping every replica")
    assert res.stderr.count("RuntimeError: a bug at step ") == 2  # at 4, then where it healed


@pytest.mark.slow
def test_the_whole_job_lost_resumes_exactly_from_its_checkpoints(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    calm = run(tmp_path / "calm", "--ckpt", str(tmp_path / "calm-ckpt"))
    first = run(tmp_path / "lost", "--ckpt", ckpt, "--epochs", "2")  # the job ends early
    again = run(tmp_path / "lost", "--ckpt", ckpt)  # ... and is run again to the end
    for res in (calm, first, again):
        assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {ckpt}/ckpt-000000024.pt at step 24" in again.stdout
    a = next(iter(ends(ledgers(tmp_path / "calm")).values()))
    b = [e for k, e in ends(ledgers(tmp_path / "lost")).items() if e["end"] == EPOCHS * STEPS]
    assert b and all(e["params"] == a["params"] for e in b)  # bitwise


# ---------------------------------------------------------------- bad input: one line
@pytest.mark.parametrize("flags, line", [
    (["--nproc", "2", "--min-replicas", "3"],
     "error: --min-replicas 3 can never be met: this node runs 2 replica(s)"),
    (["--nproc", "1", "--nnodes", "2", "--node-rank", "1"],
     "error: --fault-tolerant on several nodes needs --lighthouse HOST:PORT"),
])
def test_bad_launch_flags_are_one_line(tmp_path, flags, line):
    res = forkrun.ddpkit("run", "--fault-tolerant", *flags, SCRIPT, "--out", str(tmp_path),
                         timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith(line), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_an_unreachable_lighthouse_is_named_within_the_wait(tmp_path):
    from ddpkit.launchers.network import free_port

    port = free_port()
    began = time.monotonic()
    res = forkrun.ddpkit("run", "--fault-tolerant", "--nproc", "1", "--nnodes", "2",
                         "--node-rank", "1", "--lighthouse", f"127.0.0.1:{port}",
                         "--rdzv-timeout", "3", SCRIPT, "--out", str(tmp_path), timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith(f"error: the lighthouse 127.0.0.1:{port} is not reachable"), \
        res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert time.monotonic() - began < 30


@pytest.mark.slow
def test_too_few_replicas_for_too_long_is_one_line_naming_the_wait(tmp_path):
    res = run(tmp_path, "--step-sleep", "0.05", "--kill-step", "3", nproc=2,
              launcher=("--min-replicas", "2", "--max-restarts", "0"),
              env={"DDPKIT_QUORUM_TIMEOUT": "4"}, timeout=120)
    assert res.returncode != 0
    said = [line for line in res.stderr.splitlines() if "error:" in line or "ddpkit run:" in line]
    assert any("no quorum of at least 2 replica(s)" in line for line in said), res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_a_stop_signal_saves_and_the_same_command_resumes_exactly(tmp_path):
    from ddpkit.launchers.forked import Forked

    calm = run(tmp_path / "calm", "--ckpt", str(tmp_path / "calm-ckpt"))
    assert calm.returncode == 0, calm.stderr[-3000:]
    out, ckpt = tmp_path / "stopped", str(tmp_path / "ckpt")
    os.makedirs(out)
    argv = ["-m", "ddpkit", "run", "--fault-tolerant", "--nproc", "3", SCRIPT, "--out", str(out),
            "--epochs", str(EPOCHS), "--ckpt", ckpt]
    proc = Forked(argv + ["--step-sleep", "0.1"], env=dict(os.environ), cwd=str(out))
    try:
        _wait_for_step(out, "node0-0", 8)
        os.kill(proc.pid, signal.SIGTERM)  # as Slurm or a terminal would stop the launcher
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err[-3000:]
    again = forkrun.python(*argv, cwd=str(out), timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt}/ckpt-" in again.stdout
    a = next(iter(ends(ledgers(tmp_path / "calm")).values()))
    done = [e for e in ends(ledgers(out)).values() if e["end"] == EPOCHS * STEPS]
    assert len(done) == 3 and all(e["params"] == a["params"] for e in done)  # bitwise
