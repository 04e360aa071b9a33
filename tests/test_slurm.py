"""Slurm for real: a private cluster (slurmctld + 2 slurmd, each node its own network namespace,
munge authentication; tests/slurmcluster.py) runs what users run.

- the script `ddpkit slurm --nodes 2` prints, submitted with sbatch, trains across the two nodes
  bitwise like one node with two processes; so does `srun python train.py` with the library alone;
- the layout every task sees (tasks per node, uneven steps, a step on a subset of the nodes) comes
  from the real Slurm variables;
- preemption end to end: SIGUSR1 from Slurm (`scancel --batch --signal=USR1`, the signal that
  `--signal=B:USR1@T` sends before the time limit; the time-based delivery itself runs on Slurm's
  own schedule and is not waited for here), then a requeue by the scheduler (SIGTERM): every rank
  finishes its step, saves, the job requeues and ends bitwise like an uninterrupted run, every
  sample once per epoch;
- bad input: a wrong task layout, a batch script without srun, node names that do not resolve, a
  checkpoint directory that is not shared: one line each, at once.

Needs root and Debian's slurm-wlm + munge (`make test` installs them); skips with the reason
otherwise. The jobs run side by side on one cluster, so the file costs about its longest job.
"""
import glob
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime

import pytest
import torch

import ddpkit
import resume_script
from multinode_script import rounds
from netns import wait_for
from slurmcluster import CRED_EXPIRE, SlurmCluster, available
from test_resume import assert_bitwise_equal, assert_every_sample_once

OK, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=WHY)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
RESUME = os.path.join(HERE, "resume_script.py")
SLOW_JOB = os.path.join(HERE, "multinode_script.py")
#: What the jobs' shells need: this Python and its `ddpkit` first on PATH.
JOB_ENV = {"PATH": os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), HERE])}
#: Every training job here runs this many epochs of the resume tests' deterministic job.
EPOCHS = 2


def render(*args):
    """What `ddpkit slurm ARGS` prints."""
    res = subprocess.run([PY, "-m", "ddpkit", "slurm", *args], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return res.stdout


class Job:
    """A batch script submitted to the cluster, its output file and output directory."""

    def __init__(self, slurm, base, name, text, *options):
        self.dir = base / name
        self.out = self.dir / "out"
        self.out.mkdir(parents=True)
        self.script, self.log = self.dir / "job.sh", self.dir / "slurm.log"
        self.script.write_text(text.replace("@OUT@", str(self.out)))
        self.id = slurm.sbatch(self.script, "-o", str(self.log), *options, cwd=ROOT, env=JOB_ENV)
        self.slurm = slurm

    def wait(self, timeout=240):
        return self.slurm.wait(self.id, timeout)

    def output(self):
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def error_lines(text):
    return [line for line in text.splitlines() if "error:" in line and not line.startswith("srun:")]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with SlurmCluster(2, workdir=tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jobs):  # after `jobs`: computed while they run
    out = tmp_path_factory.mktemp("reference")
    result = ddpkit.launch(resume_script.train, 2, str(out), EPOCHS, timeout=240)
    assert result["step"] == EPOCHS * resume_script.SAMPLES // 8
    return result


# ddpkit.env.detect alone (it needs no torch, so the nine tasks below start at once): the package's
# __init__ is skipped by registering an empty package at the source directory.
LAYOUT = ("import os, sys, types; pkg = types.ModuleType('ddpkit'); "
          f"pkg.__path__ = ['{os.path.join(ROOT, 'src', 'ddpkit')}']; sys.modules['ddpkit'] = pkg; "
          "from ddpkit.env.detect import detect; e = detect(os.environ); "
          "print('layout', e.launcher, e.rank, e.world_size, e.local_rank, e.local_world_size, "
          "e.node_rank, e.master_addr, 'torch' in sys.modules, flush=True)")

BATCH_ONLY = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
python {script} --out @OUT@ --epochs 2
"""
SRUN_LIBRARY = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
srun python {script} --out @OUT@ --epochs 2
"""
LAYOUTS = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
srun python -c "{LAYOUT}" | sort
echo ---
srun -n 3 python -c "{LAYOUT}" | sort
echo ---
srun -n 2 -N 1 -w node2 python -c "{LAYOUT}" | sort
"""


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    """Every job of this file but the unresolvable-names one, submitted at once."""
    base = tmp_path_factory.mktemp("jobs")
    rendered = render("--nodes", "2", "--gpus-per-node", "0", "--no-requeue", RESUME,
                      "--out", "@OUT@", "--epochs", str(EPOCHS))
    preemptible = render("--nodes", "2", "--gpus-per-node", "0", "--requeue-grace", "60",
                         SLOW_JOB, "--out", "@OUT@", "--step-sleep", "0.15",
                         "--epochs", str(EPOCHS))
    out = {
        "preempt": Job(slurm, base, "preempt", preemptible),
        "rendered": Job(slurm, base, "rendered", rendered),
        "srun": Job(slurm, base, "srun", SRUN_LIBRARY.format(script=RESUME)),
        "layouts": Job(slurm, base, "layouts", LAYOUTS),
        "two_per_node": Job(slurm, base, "two_per_node",
                            rendered.replace("--ntasks-per-node=1", "--ntasks-per-node=2")),
        "nnodes": Job(slurm, base, "nnodes",
                      rendered.replace('--nnodes "$SLURM_NNODES"', "--nnodes 3")),
        "batch_only": Job(slurm, base, "batch_only", BATCH_ONLY.format(script=RESUME)),
        "scratch": Job(slurm, base, "scratch",
                       rendered.replace("@OUT@", str(slurm.scratch / "ckpt-here"))),
    }
    out["preempt"].driver = Preemption(slurm, out["preempt"])
    yield out
    for job in out.values():
        slurm.run("scancel", job.id, check=False)


class Preemption(threading.Thread):
    """Drives the preemptible job: SIGUSR1 from Slurm after 8 steps (`scancel --batch
    --signal=USR1`, what the time-limit warning delivers), then, 6 steps into the requeued run,
    a requeue by the scheduler (`scontrol requeue`: SIGTERM to every task). Notes when each thing
    happened."""

    def __init__(self, slurm, job):
        super().__init__(daemon=True)
        self.slurm, self.job, self.t, self.error = slurm, job, {}, None
        self.start()

    def run(self):
        try:
            self._drive()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _drive(self):
        s, job, out = self.slurm, self.job, str(self.job.out)
        wait_for(lambda: len(rounds(out).get(0, ())) >= 9, 180, "8 steps")  # start line + 8
        self.t["usr1"] = time.time()
        s.run("scancel", "--batch", "--signal=USR1", job.id)
        info = s.wait_for(job.id, lambda i: i.restarts >= 1, 120, "requeued after SIGUSR1")
        self.t["requeued1"] = time.time()
        wait_for(lambda: self._resumed_steps(1) >= 6, 180, "6 steps after the first requeue")
        self.t["term"] = time.time()
        s.run("scontrol", "requeue", job.id)
        s.wait_for(job.id, lambda i: i.restarts >= 2, 120, "requeued by scontrol")
        self.t["requeued2"] = time.time()
        self.info = s.wait(job.id, 240)
        self.t["done"] = time.time()
        self.attempts = rounds(out)
        assert info.restarts >= 1

    def _resumed_steps(self, n):
        runs = list(rounds(self.job.out).values())
        return len(runs[n]) - 1 if len(runs) > n else 0


# ----------------------------------------------------------------------------- the harness

def test_harness_brings_up_two_nodes_and_removes_everything_also_after_an_error(tmp_path):
    cluster = SlurmCluster(2, workdir=tmp_path / "c")
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            assert cluster.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split() == [
                "node1", "idle", "node2", "idle"]
            script = tmp_path / "sleep.sh"
            script.write_text("#!/bin/bash\n#SBATCH --nodes=2\nsrun sleep 300\n")
            job = cluster.sbatch(script, "-o", str(tmp_path / "sleep.log"))
            cluster.wait_for(job, lambda i: i.state == "RUNNING", 30, "running")
            namespaces = [cluster.net.ns(i) for i in range(2)] + [cluster.net.switch]
            # The daemons, munged, and everything in the nodes (slurmstepd, the job's sleeps).
            pids = [p.pid for p in cluster.daemons.values()] + [
                int(pid) for ns in namespaces for pid in subprocess.run(
                    ["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
            assert len(pids) > len(cluster.daemons)
            raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"left behind: {alive}"


# ----------------------------------------------------------------------------- what users run

def test_the_rendered_sbatch_trains_on_two_nodes_bitwise_like_one_node(jobs, reference):
    job = jobs["rendered"]
    info = job.wait()
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), job.output()[-3000:]
    assert info.nodes == "node[1-2]"
    final = torch.load(job.out / "final.pt", weights_only=True)
    assert final["step"] == reference["step"]
    assert_bitwise_equal(final["params"], reference["params"])
    assert_every_sample_once(str(job.out), EPOCHS)
    assert "Traceback" not in job.output()


def test_srun_python_with_the_library_alone_forms_the_world_from_slurm(jobs, reference):
    job = jobs["srun"]
    info = job.wait()
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), job.output()[-3000:]
    final = torch.load(job.out / "final.pt", weights_only=True)
    assert_bitwise_equal(final["params"], reference["params"])
    assert sorted(os.path.basename(p) for p in glob.glob(str(job.out / "ledger-*"))) == [
        "ledger-r0-a0-w2.jsonl", "ledger-r1-a0-w2.jsonl"]
    assert_every_sample_once(str(job.out), EPOCHS)


def test_every_task_sees_its_place_in_the_step_from_the_real_variables(jobs):
    job = jobs["layouts"]
    assert job.wait().state == "COMPLETED", job.output()
    blocks = [[line.split()[1:] for line in block.splitlines() if line.startswith("layout")]
              for block in job.output().split("---")]
    # launcher rank world local_rank local_world node_rank master
    assert blocks[0] == [["slurm", "0", "4", "0", "2", "0", "node1", "False"],
                         ["slurm", "1", "4", "1", "2", "0", "node1", "False"],
                         ["slurm", "2", "4", "0", "2", "1", "node1", "False"],
                         ["slurm", "3", "4", "1", "2", "1", "node1", "False"]]
    assert blocks[1] == [["slurm", "0", "3", "0", "2", "0", "node1", "False"],  # tasks 2,1
                         ["slurm", "1", "3", "1", "2", "0", "node1", "False"],
                         ["slurm", "2", "3", "0", "1", "1", "node1", "False"]]
    assert blocks[2] == [["slurm", "0", "2", "0", "2", "0", "node2", "False"],  # its own node
                         ["slurm", "1", "2", "1", "2", "0", "node2", "False"]]


# ----------------------------------------------------------------------------- preemption

def test_preempted_twice_by_slurm_requeues_and_resumes_bitwise_every_sample_once(
        jobs, reference):
    job = jobs["preempt"]
    driver = job.driver
    driver.join(timeout=420)
    assert not driver.is_alive(), "the preemption driver did not finish"
    if driver.error is not None:
        raise AssertionError(f"{driver.error}\n{job.output()[-4000:]}") from driver.error
    assert (driver.info.state, driver.info.restarts) == ("COMPLETED", 2), job.output()[-3000:]
    log = job.output()  # --open-mode=append: all three runs
    assert "stopped by SIGUSR1 at step" in log and "stopped by SIGTERM at step" in log, log
    assert log.count("resumed from") == 2 and "Traceback" not in log
    final = torch.load(job.out / "final.pt", weights_only=True)
    assert final["step"] == reference["step"]
    assert_bitwise_equal(final["params"], reference["params"])
    assert_every_sample_once(str(job.out), EPOCHS)
    runs = driver.attempts
    assert len(runs) == 3 and list(runs)[0] == 0
    # Figures (benchmarks/slurm_preempt.py measures them over several cycles).
    first, second, third = runs.values()
    saved = sorted(os.path.getmtime(p) for p in glob.glob(str(job.out / "ckpt" / "ckpt-*.pt")))
    figures = {
        "signal_to_last_step_s": first[-1]["t"] - driver.t["usr1"],
        "requeue_to_first_step_s": second[1]["t"] - driver.t["requeued1"],
        "requeue_wait_s": CRED_EXPIRE,
        "term_to_last_step_s": second[-1]["t"] - driver.t["term"],
    }
    print("slurm preemption:", json.dumps({k: round(v, 2) for k, v in figures.items()}))
    # the stop came within the 60 s --requeue-grace the job asked for (ddpkit's own window;
    # the agent's grace, 30 s of it, would end the step without the stop line checked above)
    assert saved and figures["signal_to_last_step_s"] < 60


# ----------------------------------------------------------------------------- bad input

def assert_one_line(job, text, code="2:0"):
    info = job.wait(120)
    log = job.output()
    assert (info.state, info.exit_code) == ("FAILED", code), log[-3000:]
    assert len(error_lines(log)) == 1, log[-3000:]
    assert text in error_lines(log)[0], log[-3000:]
    assert "Traceback" not in log
    # No hang: ended by the check that says the line, not by a timeout (the rendezvous waits
    # 600 s, a collective 30 min). The jobs start side by side on 2 cores; the shared-directory
    # check looks for 10 s first; 300 s leaves a host 3x slower room and is half the first timeout.
    started, ended = (datetime.fromisoformat(info.fields[k]) for k in ("StartTime", "EndTime"))
    assert (ended - started).total_seconds() < 300, f"took {ended - started}"
    return info


def test_two_tasks_per_node_around_ddpkit_run_is_one_line(jobs):
    assert_one_line(jobs["two_per_node"], "error: srun started 2 tasks on node1")
    assert "--ntasks-per-node=1" in error_lines(jobs["two_per_node"].output())[0]


def test_nnodes_other_than_the_steps_is_one_line(jobs):
    assert_one_line(jobs["nnodes"], 'ddpkit run --nnodes 3, but this srun step runs on 2 node(s)')


def test_a_batch_script_without_srun_is_one_line_not_a_hang(jobs):
    assert_one_line(jobs["batch_only"], "is the batch script of Slurm job")
    assert "srun python train.py" in error_lines(jobs["batch_only"].output())[0]


def test_a_checkpoint_directory_on_node_local_disk_is_one_line_before_training(jobs):
    job = jobs["scratch"]
    assert_one_line(job, "is not shared between the nodes: node2 cannot see what rank 0 "
                         "writes there on node1")
    assert "epoch 1/3" not in job.output()  # stopped before any training


def test_node_names_that_do_not_resolve_are_one_line_each_way(tmp_path):
    with SlurmCluster(2, workdir=tmp_path / "c", resolvable=False) as slurm:
        library = Job(slurm, tmp_path, "srun", SRUN_LIBRARY.format(script=RESUME))
        rendered = Job(slurm, tmp_path, "rendered",
                       render("--nodes", "2", "--gpus-per-node", "0", "--no-requeue", RESUME,
                              "--out", "@OUT@"))
        # Whether a name resolves can differ between nodes: each task that cannot says so.
        info = library.wait(120)
        lines = error_lines(library.output())
        assert (info.state, info.exit_code) == ("FAILED", "2:0"), library.output()[-3000:]
        assert sorted(line.split("error:")[0] for line in lines) == ["", "[rank 1] "], lines
        assert all("master host 'node1' (the first node of the Slurm nodelist node[1-2]) does "
                   "not resolve on this node" in line and "MASTER_ADDR" in line for line in lines)
        assert "Traceback" not in library.output()
        info = rendered.wait(120)
        log = rendered.output()
        assert info.state == "FAILED" and "Traceback" not in log, log[-3000:]
        assert [line for line in error_lines(log)] and all(
            "rendezvous host 'node1' does not resolve" in line for line in error_lines(log)), log


# ----------------------------------------------------------------------------- elastic

def test_an_elastic_job_that_loses_a_node_goes_on_with_the_others(tmp_path):
    """`ddpkit slurm --min-nodes 1` on 2 nodes; node2 dies (slurmd, its task, its worker: kill -9
    of everything in the node): the job goes on with node1 from the newest checkpoint, every
    sample once, and ends COMPLETED. Its own cluster: a node is lost for good here."""
    with SlurmCluster(2, workdir=tmp_path / "slurm", slurmd_timeout=10) as s:
        text = render("--nodes", "2", "--min-nodes", "1", "--gpus-per-node", "0", "--no-requeue",
                      SLOW_JOB, "--out", "@OUT@", "--step-sleep", "0.3", "--epochs", "3",
                      "--timeout-s", "10")
        assert "#SBATCH --no-kill" in text and "--nnodes 1:\"$SLURM_NNODES\"" in text
        job = Job(s, tmp_path, "elastic", text)
        wait_for(lambda: len(rounds(job.out).get(0, ())) >= 8, 180, "7 steps on 2 nodes")
        s.net.kill(1)  # node2 is gone: slurmd and everything it started
        info = job.wait(240)
        log = job.output()
        assert info.state == "COMPLETED", log[-3000:]
        assert "node node2 (10.213.0.2) left; 1 node goes on (node1 (10.213.0.1))" in log, log
        assert "on 1 processes (the checkpoint was written by 2); each batch still spans 8 " \
               "samples: 8 a rank, was 4" in log, log
        assert "srun: error: Node failure on node2" in log  # Slurm saw the node go
    final = torch.load(job.out / "final.pt", weights_only=True)
    assert final["step"] == 3 * resume_script.SAMPLES // 8
    assert_every_sample_once(str(job.out), 3)


def test_a_fault_tolerant_job_that_loses_a_node_goes_on_without_a_restart(tmp_path):
    """`ddpkit slurm --fault-tolerant` on 2 nodes (a replica each; the first node runs the
    lighthouse); node2 dies (slurmd, its task, its replica: kill -9 of everything in the
    node): node1's replica never restarts, goes on alone, every sample once, COMPLETED."""
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'ddpkit[ft]')")
    import live_script
    from test_live import EPOCHS as LIVE_EPOCHS, STEPS, assert_every_sample_once as each_once
    from test_live import ends, ledgers

    with SlurmCluster(2, workdir=tmp_path / "slurm", slurmd_timeout=10) as s:
        text = render("--nodes", "2", "--min-nodes", "1", "--gpus-per-node", "0",
                      "--fault-tolerant", "--no-requeue",
                      os.path.join(HERE, "live_script.py"), "--out", "@OUT@",
                      "--step-sleep", "0.2", "--epochs", str(LIVE_EPOCHS))
        assert "#SBATCH --no-kill" in text and "ddpkit run --fault-tolerant" in text
        job = Job(s, tmp_path, "ft", text)

        def steps_of(replica):
            return [r for r in ledgers(job.out).get((replica, 0), []) if "step" in r]

        wait_for(lambda: len(steps_of("node1-0")) >= 8, 180, "8 steps on 2 nodes")
        s.net.kill(1)  # node2 is gone: slurmd and everything it started
        info = job.wait(240)
        log = job.output()
        assert info.state == "COMPLETED", log[-3000:]
        assert "ddpkit: step " in log and "committed by 1 replica(s) (2 before)" in log, log
        assert "srun: error: Node failure on node2" in log  # Slurm saw the node go
    found = ledgers(job.out)
    assert ("node0-0", 1) not in found  # the survivor never restarted
    each_once(found)
    assert ends(found)[("node0-0", 0)]["end"] == LIVE_EPOCHS * STEPS
    assert live_script.SAMPLES == 91
