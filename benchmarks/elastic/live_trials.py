"""kill -9 at random moments in fault-tolerant runs (issue 57): three replicas of
tests/live_script.py on this machine (`ddpkit run --fault-tolerant --nproc 3`, checkpoints
every 5 steps, written in the background), one replica killed at a random time, and in half the
trials a second one (or the same, back and healing) a random fraction of a second later. Each
trial must end with exit 0, every sample of every epoch counted once (DDPKIT_LIVE_LEDGER: each
replica logs its share before its all-reduce, and each step it committed; the shares of every
committed step and quorum are counted), and every replica holding the very same weights.

    python benchmarks/elastic/live_trials.py --trials 20 --seed 0
"""
import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_live import ends, ledgers, EPOCHS, STEPS  # noqa: E402
sys.path.insert(0, HERE)
from live import count_samples  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "live_script.py")


def replica_pids(out):
    """{replica: pid} of the attempts running now (each ledger's first line names its pid)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "ledger-*.jsonl"))):
        replica = os.path.basename(path)[7:-6].rsplit("-", 1)[0]
        with open(path) as f:
            first = f.readline()
        if first:
            pid = json.loads(first)["pid"]
            if os.path.exists(f"/proc/{pid}"):
                found[replica] = pid
    return found


def trial(rng, n):
    out = tempfile.mkdtemp(prefix="ddpkit-trial-")
    cmd = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerant", "--nproc", "3", SCRIPT,
           "--out", out, "--epochs", str(EPOCHS), "--ckpt", os.path.join(out, "ckpt"),
           "--async-save", "--step-sleep", "0.15"]
    audit = os.path.join(out, "audit")  # each share logged before its all-reduce
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "DDPKIT_LIVE_LEDGER": audit})
    while len(replica_pids(out)) < 3 and proc.poll() is None:  # training has begun
        time.sleep(0.01)
    began = time.monotonic()
    kills = []
    plan = [rng.uniform(0.2, 4.0)]  # 36 steps of ~0.15 s: anywhere in the run
    if rng.random() < 0.5:
        plan.append(plan[0] + rng.uniform(0.1, 1.5))  # often while the first one heals
    for at in plan:
        while time.monotonic() - began < at and proc.poll() is None:
            time.sleep(0.01)
        pids = replica_pids(out)
        if proc.poll() is not None or not pids:
            break
        victim = rng.choice(sorted(pids))
        os.kill(pids[victim], signal.SIGKILL)
        kills.append({"victim": victim, "at_s": round(time.monotonic() - began, 2)})
    _, err = proc.communicate(timeout=300)
    found = ledgers(out)
    done = ends(found)
    row = {"trial": n, "kills": kills, "exit": proc.returncode,
           "restarts": sum(1 for (_, attempt) in found if attempt > 0),
           "finished": len(done), "steps": max((e["end"] for e in done.values()), default=0)}
    try:
        assert proc.returncode == 0, err[-2000:]
        counted = count_samples(audit)  # every share of every committed (step, quorum)
        assert counted["steps"] == EPOCHS * STEPS and counted["times_each"] == [EPOCHS], counted
        assert len({json.dumps(e["params"]) for e in done.values()}) == 1
        assert row["steps"] == EPOCHS * STEPS
        row["ok"] = True
    except AssertionError as exc:
        row["ok"], row["why"] = False, str(exc)[:500]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    rows = [trial(rng, n) for n in range(args.trials)]
    for row in rows:
        print(json.dumps(row), flush=True)
    kills = sum(len(r["kills"]) for r in rows)
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} trials ended right ({kills} kills, "
          f"{sum(r['restarts'] for r in rows)} replicas restarted): exit 0, every sample once "
          "per epoch, every replica's weights equal")


if __name__ == "__main__":
    main()
