"""`ddpkit k8s` manifests run for real on simulated pods (tests/k8spods.py: network namespaces
named as the pods, started with exactly the command and environment the manifest or Kubeflow
Trainer's operator gives them; no Kubernetes control plane runs here). Two pods train bitwise
like two local processes; an evicted pod checkpoints within its grace period, a new pod takes
its place and the job ends bitwise as if nothing happened. Needs root; skips otherwise."""
import os
import subprocess
import sys
import time

import pytest
import torch

import resume_script
from k8spods import PodCluster, ddpkit_bin, from_manifest
from netns import available
from test_multinode import ledger_lines
from test_resume import assert_bitwise_equal, assert_every_sample_once

OK, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.multinode, pytest.mark.skipif(not OK, reason=WHY)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESUME = os.path.join(HERE, "resume_script.py")
SLOW_JOB = os.path.join(HERE, "multinode_script.py")
GRACE = 60


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 node x 2 processes over loopback, started at once (it overlaps the first test)."""
    out = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc", "2", RESUME,
                             "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    cache = {}

    def result():
        if not cache:
            log, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, log
            cache.update(torch.load(out / "final.pt", weights_only=True))
        return cache

    yield result
    if proc.poll() is None:
        proc.kill()


def manifest(kind, script, *args):
    res = subprocess.run([sys.executable, "-m", "ddpkit", "k8s", "--kind", kind, "--nodes", "2",
                          "--gpus-per-node", "0", "--image", "ddpkit:test", "--name", "train",
                          "--pvc", "shared:/shared", "--grace-period", str(GRACE), script, *args],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_an_indexed_job_trains_on_two_pods_like_two_local_processes(tmp_path, reference):
    out = tmp_path / "shared"   # the PVC both pods mount
    out.mkdir()
    job = from_manifest(manifest("indexed-job", RESUME, "--out", str(out)))
    assert [p.hostname for p in job.pods] == ["train-0", "train-1"]
    assert "--node-rank" in job.pods[1].command and job.pods[1].command[
        job.pods[1].command.index("--node-rank") + 1] == "1"  # $(JOB_COMPLETION_INDEX), expanded
    with PodCluster(job, tmp_path / "pods", ddpkit_bin()) as c:
        # pod 1 first: pod 0's DNS name (the rendezvous) does not resolve until it starts;
        # pod 0 starts once pod 1 says it waits (a fixed 3 s was not always enough for pod 1 to
        # get that far on a loaded machine: pod 0 had started by then, and nothing waited)
        assert c.run_job(str(ROOT), timeout=240, order=[1, 0],
                         start_when=lambda c: "to resolve" in c.output(1)), c.tails()
        assert c.starts == [1, 1] and c.failures == 0
        assert "waiting up to 600 s for the rendezvous host train-0.train to resolve" in \
            c.output(1)
    final = torch.load(out / "final.pt", weights_only=True)
    expected = reference()
    assert final["step"] == expected["step"] == 3 * resume_script.SAMPLES // 8
    assert_bitwise_equal(final["params"], expected["params"])
    assert_every_sample_once(str(out), 3)


def test_an_evicted_trainjob_pod_checkpoints_in_its_grace_period_and_the_job_resumes_exactly(
        tmp_path, reference):
    out = tmp_path / "shared"
    out.mkdir()
    job = from_manifest(manifest("trainjob", SLOW_JOB, "--out", str(out), "--step-sleep", "0.3",
                                 "--timeout-s", "60"))
    assert [p.hostname for p in job.pods] == ["train-node-0-0", "train-node-0-1"]
    assert job.pods[1].env["PET_NODE_RANK"] == "1" and job.pods[1].command[:2] == ["ddpkit",
                                                                                   "run"]
    seen = {}

    def evict_once(c):
        if not seen and ledger_lines(str(out)) >= 5:   # mid-epoch
            seen["at"] = time.monotonic()
            c.evict(1)
        if "at" in seen and "gone" not in seen and c.procs[1].poll() is not None:
            seen["gone"] = time.monotonic() - seen["at"]

    with PodCluster(job, tmp_path / "pods", ddpkit_bin()) as c:
        assert c.run_job(str(ROOT), timeout=300, on_tick=evict_once), c.tails()
        logs = c.output(0) + c.output(1)
        evicted_said = "stopped by SIGTERM at step" in c.output(1)   # rank 0 on the evicted pod?
    # a new pod for the evicted one; the runtime's Job counts the eviction as 1 of its 6 failures
    assert c.starts == [1, 2] and c.failures == 1, (c.starts, c.failures)
    # the evicted pod's workers and their peers stopped after the same step and saved it, well
    # inside the grace period the manifest set; the new pod's group resumed from that step
    assert seen["gone"] < GRACE - 10, seen
    stopped = [line for line in logs.splitlines() if "stopped by SIGTERM at step" in line]
    assert stopped, logs[-3000:]
    step = int(stopped[0].split(" at step ")[1].split()[0])
    # rank 0 says when it saved after its own signal, or that the signal reached another rank
    assert ("s after the signal" if evicted_said else "(the signal reached another rank)") \
        in stopped[0], stopped
    assert "resumed from" in logs and os.path.isdir(out / "ckpt"), logs[-3000:]
    final = torch.load(out / "final.pt", weights_only=True)
    expected = reference()
    assert 0 < step < final["step"] == expected["step"]
    assert_bitwise_equal(final["params"], expected["params"])
    assert_every_sample_once(str(out), 3)
