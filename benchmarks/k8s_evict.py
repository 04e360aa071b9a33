"""Evictions on simulated Kubernetes pods: how long from the kubelet's SIGTERM to the checkpoint,
to the pod's exit, and from the replacement pod's start to the first resumed step.

    sudo python benchmarks/k8s_evict.py [--kind trainjob|indexed-job] [--cycles 3] [--json F]

No control plane runs here (none can be installed): tests/k8spods.py plays it. Each pod of the
manifest `ddpkit k8s --nodes 2 --gpus-per-node 0` renders around tests/multinode_script.py (the
deterministic job of the resume tests, 0.3 s per step) is a network namespace with the pod's
hostname, started with exactly the command and environment the manifest (or Kubeflow Trainer's
torch plugin) gives it. Each cycle: wait for 4 more steps, evict pod 1 (SIGTERM, SIGKILL after the
grace period), start a new pod for it as the Job controller does, then time

- signal -> checkpoint: the newest checkpoint file's mtime after the signal;
- signal -> pod gone: when the evicted pod's main process (ddpkit run) exited;
- new pod -> first step: ddpkit's start in the new pod (Python, the rendezvous with the pod that
  stayed, whose agent restarted its workers, loading the checkpoint) to the first optimizer step
  of the resumed run (the job's own ledger).

Times are wall clock on this one host. Medians over ``--cycles``; the pods' logs are printed
(abridged, in arrival order) for the README.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from k8spods import PodCluster, ddpkit_bin, from_manifest  # noqa: E402
from multinode_script import rounds  # noqa: E402
from netns import available, wait_for  # noqa: E402

GRACE = 60
#: The lines of the pods' logs the README shows (the abridged log), in arrival order.
KEEP = ("stopped by", "resumed from", "ddpkit run:", "epoch ", "no checkpoint", "checkpoints every")


def _newest_ckpt(out: Path) -> float:
    times = [os.path.getmtime(p) for p in glob.glob(str(out / "ckpt" / "ckpt-*.pt"))]
    return max(times, default=0.0)


def _steps(out: Path) -> int:
    return sum(len(r) - 1 for r in rounds(str(out)).values())


def measure(kind: str, cycles: int, workdir: Path) -> dict:
    out = workdir / "shared"   # the PVC every pod mounts
    out.mkdir(parents=True)
    text = subprocess.run(
        [sys.executable, "-m", "ddpkit", "k8s", "--kind", kind, "--nodes", "2",
         "--gpus-per-node", "0", "--image", "ddpkit:bench", "--name", "train", "--pvc",
         "shared:/shared", "--grace-period", str(GRACE), "--max-restarts", str(cycles + 1),
         str(ROOT / "tests" / "multinode_script.py"), "--out", str(out), "--step-sleep", "0.3",
         "--epochs", str(2 + cycles), "--timeout-s", "60"],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout
    job = from_manifest(text)
    rows = []
    with PodCluster(job, workdir / "pods", ddpkit_bin()) as c:
        for i in range(c.nodes):
            c.start_pod(i, str(ROOT))
        for cycle in range(cycles):
            target = _steps(out) + 4
            wait_for(lambda: _steps(out) >= target, 240, f"4 more steps before eviction {cycle}")
            before, runs_before = _newest_ckpt(out), len(rounds(str(out)))
            t_signal = time.time()
            c.evict(1)
            c.procs[1].wait(timeout=GRACE + 5)
            t_gone = time.time()
            c.start_pod(1, str(ROOT))       # the Job controller's new pod for index 1
            t_new = time.time()
            wait_for(lambda: len(rounds(str(out))) > runs_before
                     and len(list(rounds(str(out)).values())[-1]) > 1, 240, "first step")
            first_step = list(rounds(str(out)).values())[-1][1]["t"]
            saved = _newest_ckpt(out)
            rows.append({"signal_to_checkpoint_s": saved - t_signal if saved > before else None,
                         "signal_to_pod_gone_s": t_gone - t_signal,
                         "new_pod_to_first_step_s": first_step - t_new,
                         "signal_to_first_step_s": first_step - t_signal})
        codes = c.wait(timeout=600)
        log = "\n".join(f"[{job.pods[node].hostname}] {line.rstrip()}" for _, node, line in c.lines
                        if line.startswith(KEEP))
    medians = {k: round(statistics.median(r[k] for r in rows if r[k] is not None), 2)
               for k in rows[0]}
    return {"kind": kind, "cycles": rows, "median": medians, "exit_codes": codes, "log": log}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("trainjob", "indexed-job"), default="trainjob")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    ok, why = available()
    if not ok:
        print(f"skipped: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ddpkit-k8s-bench-") as tmp:
        result = measure(args.kind, args.cycles, Path(tmp))
    print(f"--- the pods' logs, abridged\n{result.pop('log')}")
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(code == 0 for code in result["exit_codes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
