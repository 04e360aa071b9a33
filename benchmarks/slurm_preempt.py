"""Preemption on a real Slurm cluster: how long from Slurm's signal to the checkpoint, and from the
requeue to the first step of the resumed job.

    sudo python benchmarks/slurm_preempt.py [--cycles 3] [--json out.json]   # ~2 min on 2 cores

A private cluster (tests/slurmcluster.py: slurmctld + 2 slurmd in network namespaces, munge; Debian's
slurm-wlm, `bash scripts/install_slurm.sh`) runs the script `ddpkit slurm --nodes 2
--gpus-per-node 0` renders around tests/multinode_script.py (the deterministic job of the resume
tests, 0.2 s per step). Each cycle: wait for 4 steps, `scancel --batch --signal=USR1 JOB` (what
`--signal=B:USR1@T` delivers before the time limit), then time

- signal -> checkpoint: the new checkpoint file's mtime after the signal;
- signal -> requeued: when `scontrol show job` first shows one more restart (the ranks finished
  their step, saved, stopped with 138; the batch script ran `scontrol requeue`);
- requeued -> running: Slurm holds a requeued job for its credential lifetime (`cred_expire`,
  120 s by default; the test cluster sets 10 s);
- running -> first step: ddpkit's start (Python, rendezvous across the nodes, loading the
  checkpoint) to the first optimizer step of the resumed run (the job's own ledger).

Times are wall clock on this one host (the nodes share its clock). Medians over ``--cycles``.

``--time-limit``: no `scancel`; the job gets `--time=00:01:00 --requeue-grace 50` and runs about
two minutes of steps, so Slurm itself sends SIGUSR1 before each time limit, on its own schedule
(slurmctld checks time limits periodically); reports how often the job was requeued, when the
signal came in each run, and that every sample was seen once per epoch over all runs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from multinode_script import rounds  # noqa: E402
from netns import wait_for  # noqa: E402
from slurmcluster import CRED_EXPIRE, SlurmCluster, available  # noqa: E402


def _newest_ckpt(out: Path) -> float:
    times = [os.path.getmtime(p) for p in glob.glob(str(out / "ckpt" / "ckpt-*.pt"))]
    return max(times, default=0.0)


def measure(cycles: int, workdir: Path) -> dict:
    out = workdir / "out"
    out.mkdir(parents=True)
    text = subprocess.run(
        [sys.executable, "-m", "ddpkit", "slurm", "--nodes", "2", "--gpus-per-node", "0",
         "--requeue-grace", "60", str(ROOT / "tests" / "multinode_script.py"), "--out", str(out),
         "--step-sleep", "0.2", "--epochs", str(2 + cycles)],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout
    script = workdir / "job.sh"
    script.write_text(text)
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    rows = []
    with SlurmCluster(2, workdir=workdir / "cluster") as slurm:
        job = slurm.sbatch(script, "-o", str(workdir / "slurm.log"), cwd=ROOT, env=env)
        for cycle in range(cycles):
            def steps_now() -> int:
                runs = list(rounds(out).values())
                return len(runs[cycle]) - 1 if len(runs) > cycle else 0
            wait_for(lambda: steps_now() >= 4, 180, f"4 steps in run {cycle}")
            before = _newest_ckpt(out)
            t_signal = time.time()
            slurm.run("scancel", "--batch", "--signal=USR1", job)
            slurm.wait_for(job, lambda i: i.restarts > cycle, 120, "requeued", every=0.1)
            t_requeued = time.time()
            slurm.wait_for(job, lambda i: i.state == "RUNNING", 300, "running again", every=0.1)
            t_running = time.time()
            wait_for(lambda: len(rounds(out)) > cycle + 1
                     and len(list(rounds(out).values())[cycle + 1]) > 1, 180, "first step")
            first_step = list(rounds(out).values())[cycle + 1][1]["t"]
            saved = _newest_ckpt(out)
            rows.append({"signal_to_checkpoint_s": saved - t_signal if saved > before else None,
                         "signal_to_requeued_s": t_requeued - t_signal,
                         "requeued_to_running_s": t_running - t_requeued,
                         "running_to_first_step_s": first_step - t_running,
                         "requeued_to_first_step_s": first_step - t_requeued})
        info = slurm.wait(job, 600)
    log = (workdir / "slurm.log").read_text(errors="replace")
    said = [float(x) for x in re.findall(r"saved ([\d.]+) s after the signal", log)]
    medians = {k: round(statistics.median(r[k] for r in rows if r[k] is not None), 2)
               for k in rows[0]}
    return {"cycles": rows, "median": medians, "ddpkit_says_saved_after_s": said,
            "cred_expire_s": CRED_EXPIRE, "final_state": info.state, "restarts": info.restarts}


def time_limit(workdir: Path) -> dict:
    """The real time-limit path: Slurm's own SIGUSR1 before `--time` ends, requeue, resume."""
    from test_resume import assert_every_sample_once

    out = workdir / "out"
    out.mkdir(parents=True)
    text = subprocess.run(
        [sys.executable, "-m", "ddpkit", "slurm", "--nodes", "2", "--gpus-per-node", "0",
         "--time", "00:01:00", "--requeue-grace", "50",
         str(ROOT / "tests" / "multinode_script.py"), "--out", str(out), "--step-sleep", "3.3"],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout
    script = workdir / "job.sh"
    script.write_text(text)
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    with SlurmCluster(2, workdir=workdir / "cluster") as slurm:
        start = time.time()
        job = slurm.sbatch(script, "-o", str(workdir / "slurm.log"), cwd=ROOT, env=env)
        info = slurm.wait(job, 900)
    log = (workdir / "slurm.log").read_text(errors="replace")
    runs = rounds(out)
    assert_every_sample_once(str(out), 3)
    return {"final_state": info.state, "restarts": info.restarts, "wall_s": time.time() - start,
            "runs_started_at_step": list(runs),
            "seconds_into_each_run_when_stopped": [
                round(r[-1]["t"] - r[0]["t"], 1) for r in list(runs.values())[:-1]],
            "stops": re.findall(r"stopped by (SIG\w+) at step (\d+)", log),
            "every_sample_once_per_epoch": True}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--time-limit", action="store_true",
                   help="let Slurm's own time-limit signal preempt the job (about 3 minutes)")
    args = p.parse_args()
    ok, why = available()
    if not ok:
        print(f"skipped: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ddpkit-slurm-bench-") as tmp:
        result = (time_limit(Path(tmp)) if args.time_limit else measure(args.cycles, Path(tmp)))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result["final_state"] == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
