"""Elastic across machines, for real: 3 nodes (network namespaces, tests/netns.py) with
``--nnodes 2:3``. A node is killed mid-epoch: the other two go on from the newest checkpoint at
world size 2; it is started again: the job grows back to 3 at a checkpoint. The run ends within
floating-point tolerance of an uninterrupted one, every sample once per epoch, exit status 0.

Also: too few nodes left (one line naming who is missing, the checkpoint intact) and nodes that
disagree on MIN:MAX. The scenarios run side by side (they mostly wait), about a minute.
"""
import glob
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import resume_script
from multinode_script import rounds
from netns import Cluster, available, wait_for
from test_multinode import ledger_lines
from test_resume import assert_every_sample_once

OK, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=WHY)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
SLOW_JOB = os.path.join(HERE, "multinode_script.py")
PORT = 29400
EPOCHS, BATCH = 5, 12  # 8 steps an epoch; 12 splits over 2 and 3 ranks
JOB = ["--timeout-s", "10", "--step-sleep", "0.4", "--batch", str(BATCH), "--epochs", str(EPOCHS)]


def elastic_run(c, out, nnodes="2:3", extra=()):
    return [PY, "-m", "ddpkit", "run", "--nnodes", nnodes, "--nproc", "1", "--rdzv-endpoint",
            f"{c.ip(0)}:{PORT}", "--rdzv-last-call", "3", *extra, SLOW_JOB, "--out", out, *JOB]


def _shrink_and_grow(tmp):
    """Kill node 2 after 6 steps; start it again once the job goes on without it."""
    out = os.path.join(tmp, "shared")  # the checkpoint directory every node sees
    os.makedirs(out)
    with Cluster(3, workdir=os.path.join(tmp, "nodes")) as c:
        for i in range(3):
            c.start(i, elastic_run(c, out), cwd=ROOT)
        wait_for(lambda: ledger_lines(out) >= 6, 150, "6 training steps")
        killed = time.time()
        c.kill(2)
        wait_for(lambda: glob.glob(os.path.join(out, "ledger-r0-*-w2.jsonl")), 90,
                 "the job going on with 2 nodes")
        restarted = time.time()
        c.start(2, elastic_run(c, out), cwd=ROOT)
        codes = c.wait(timeout=180)
        return {"codes": codes, "out": [c.output(i) for i in range(3)], "dir": out,
                "killed": killed, "restarted": restarted, "tails": c.tails(30)}


def _too_few(tmp):
    """2 nodes with --nnodes 2:3; node 1 dies: node 0 cannot go on alone."""
    out = os.path.join(tmp, "shared")
    os.makedirs(out)
    with Cluster(2, workdir=os.path.join(tmp, "nodes")) as c:
        for i in range(2):
            c.start(i, elastic_run(c, out, extra=["--rdzv-timeout", "15"]), cwd=ROOT)
        wait_for(lambda: ledger_lines(out) >= 5, 150, "5 training steps")
        c.kill(1)
        codes = c.wait(timeout=90, nodes=[0])
        return {"codes": codes, "out": [c.output(0)], "dir": out, "names": [c.hostname(1)]}


def _disagree(tmp):
    """Node 0 says --nnodes 2:3, node 1 --nnodes 2: both stop with one line."""
    out = os.path.join(tmp, "shared")
    os.makedirs(out)
    with Cluster(2, workdir=os.path.join(tmp, "nodes")) as c:
        c.start(0, elastic_run(c, out), cwd=ROOT)
        time.sleep(2)
        c.start(1, elastic_run(c, out, nnodes="2"), cwd=ROOT)
        codes = c.wait(timeout=90)
        return {"codes": codes, "out": [c.output(i) for i in range(2)]}


def _reference(tmp):
    """The same job uninterrupted on 3 processes of one node."""
    out = os.path.join(tmp, "ref")
    os.makedirs(out)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([PY, "-m", "ddpkit", "run", "--nproc", "3", SLOW_JOB, "--out", out,
                          "--batch", str(BATCH), "--epochs", str(EPOCHS), "--step-sleep", "0.05"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    results = {}

    def run(name, *fns):
        for fn in fns:
            try:
                results[fn.__name__] = fn(str(tmp_path_factory.mktemp(fn.__name__)))
            except Exception as exc:  # reported by the test that reads it
                results[fn.__name__] = exc

    threads = [threading.Thread(target=run, args=("a", _shrink_and_grow)),
               threading.Thread(target=run, args=("b", _disagree, _too_few)),
               threading.Thread(target=run, args=("c", _reference))]
    for t in threads:
        t.start()
        time.sleep(2)  # stagger the torch imports a little
    for t in threads:
        t.join()
    return results


def outcome(outcomes, name):
    result = outcomes[name]
    if isinstance(result, Exception):
        raise result
    return result


def test_a_killed_node_leaves_and_rejoins_and_the_run_ends_as_if_nothing_happened(outcomes):
    r = outcome(outcomes, "_shrink_and_grow")
    assert r["codes"] == [0, 0, 0], r["tails"]
    runs = rounds(r["dir"])  # {start step: rank 0's records}, in order
    worlds = [int(p.rsplit("-w", 1)[1].split(".")[0])
              for p in sorted(glob.glob(os.path.join(r["dir"], "ledger-r0-*")),
                              key=lambda p: int(p.split("-a")[1].split("-")[0]))]
    assert worlds == [3, 2, 3], worlds  # shrank to 2, grew back to 3
    final = torch.load(os.path.join(r["dir"], "final.pt"), weights_only=True)
    reference = outcome(outcomes, "_reference")
    assert final["step"] == reference["step"] == EPOCHS * resume_script.SAMPLES // BATCH
    for got, want in zip(final["params"], reference["params"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the sum order differs
    assert_every_sample_once(r["dir"], EPOCHS)
    head = r["out"][0]
    lost, resumed = list(runs.values())[1][0], list(runs)[1]
    print(f"node loss to the next step: {lost['t'] - r['killed']:.1f} s")  # -s shows it
    assert "ddpkit run: 3 nodes joined (--nnodes 2:3)" in head
    assert "after step" in head and "lost a peer at 10.213.0.3" in head
    assert "(10.213.0.3) left; 2 nodes go on" in head
    assert f"resumed at step {resumed} on 2 processes (the checkpoint was written by 3); " \
           f"global batch {BATCH} kept: 6 a rank, was 4" in head
    assert "a node is waiting to join: every rank checkpoints at its next step" in head
    assert "(10.213.0.3) joined; 3 nodes go on" in head
    assert "global batch 12 kept: 4 a rank, was 6" in head
    assert "checkpoints every 2 steps: a failure loses" in head


def test_too_few_nodes_left_is_one_line_naming_who_is_missing(outcomes):
    r = outcome(outcomes, "_too_few")
    assert r["codes"] != [0]
    errors = [line for line in r["out"][0].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r["out"][0][-3000:]
    assert "did not gather 2 nodes within 15 s; the last group was" in errors[0]
    assert f"{r['names'][0]} (10.213.0.2) did not come back (need 2 of --nnodes 2:3)" in errors[0]
    # The checkpoint is intact: the newest one loads.
    newest = sorted(glob.glob(os.path.join(r["dir"], "ckpt", "ckpt-*.pt")))[-1]
    assert torch.load(newest, weights_only=False)["progress"]["step"] >= 2


def test_nodes_that_disagree_on_the_range_stop_with_one_line(outcomes):
    r = outcome(outcomes, "_disagree")
    assert 0 not in r["codes"]
    said = "\n".join(r["out"])
    assert "error: this node was started with --nnodes 2 but another node of the rendezvous" \
           in said and "with --nnodes 2:3: use the same --nnodes on every node" in said
