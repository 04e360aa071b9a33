"""How soon a stuck rank is named, and how often something that is not stuck is (issue 35).

Detection: ``--trials`` runs of ``tests/stall_script.py`` (a small DDP loop) under default
settings, one rank of which stops making progress at a random step (the faults in turn: an
infinite loop, a deadlock on a lock, a read that never returns, SIGSTOP); the time from the
fault to the report line, on 1 node (2 processes) or on 3 network-namespace nodes (one process
each; root). False alarms: ``ddpkit train`` for ``--false-alarm-minutes`` with an evaluation and
a checkpoint every epoch, counting the stall reports (there is nothing stuck in it).

    python benchmarks/stall/detect.py --trials 20 --nodes 1
    sudo python benchmarks/stall/detect.py --trials 20 --nodes 3
    python benchmarks/stall/detect.py --false-alarm-minutes 30

Prints one line per trial and a summary; ``--json`` writes them too.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
SCRIPT = os.path.join(TESTS, "stall_script.py")
PY = sys.executable
FAULTS = ("loop", "lock", "read", "stop")
CLEAN = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
STUCK = " is stuck: "


def one_node(fault: str, at: int, out: str) -> dict:
    """2 processes on this host; returns seconds from the fault to the report (None: never)."""
    cmd = [PY, "-m", "ddpkit", "run", "--nproc", "2", "--timeout", "15", SCRIPT, "--fault",
           fault, "--rank", "1", "--at", str(at), "--steps", str(at + 30), "--out", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**CLEAN, "PYTHONPATH": os.path.join(ROOT, "src")}, cwd=out)
    began = named = None
    lines = []
    for line in proc.stdout:
        now = time.time()
        lines.append(line)
        if line.startswith("fault at"):
            began = float(line.split()[-1])
        if STUCK in line and line.startswith("ddpkit: rank") and named is None:
            named = now
    proc.wait()
    return {"fault": fault, "at": at, "named_after": None if named is None or began is None
            else round(named - began, 2), "reports": sum(STUCK in l for l in lines),
            "line": next((_with_stack(lines, i) for i, l in enumerate(lines) if STUCK in l), "")}


def three_nodes(fault: str, at: int, out: str) -> dict:
    """3 network-namespace nodes, one process each (tests/netns.py); rank 2 is the stuck one."""
    sys.path.insert(0, TESTS)
    from netns import Cluster, wait_for

    with Cluster(3, workdir=os.path.join(out, "nodes")) as c:
        for i in range(3):
            c.start(i, [PY, "-m", "ddpkit", "run", "--nnodes", "3", "--nproc", "1",
                        "--rdzv-endpoint", f"{c.ip(0)}:29400", "--timeout", "15", SCRIPT,
                        "--fault", fault, "--rank", "2", "--at", str(at), "--steps",
                        str(at + 30), "--out", out], cwd=ROOT)
        wait_for(lambda: "fault at" in c.output(2), 150, "the fault")
        began = float(re.search(r"fault at ([\d.]+)", c.output(2)).group(1))
        named = None
        deadline = time.monotonic() + 30
        while named is None and time.monotonic() < deadline:
            if STUCK in c.output(0):
                named = time.time()
            time.sleep(0.05)
        text = c.output(0)
        c.wait(timeout=60, nodes=[0])
    return {"fault": fault, "at": at, "named_after": None if named is None
            else round(named - began, 2), "reports": text.count(STUCK),
            "line": next((_with_stack(text.splitlines(), i) for i, l in enumerate(text.splitlines())
                          if STUCK in l), "")}


def false_alarms(minutes: float, out: str) -> dict:
    """ddpkit train (ResNet-18 on synthetic images: ~1 s steps here) with an evaluation and a
    checkpoint every epoch, for ``minutes``; then Ctrl-C. Counts the stall reports."""
    cmd = [PY, "-m", "ddpkit", "train", "--output", os.path.join(out, "run"), "--no-progress",
           "--model", "resnet18", "--data", "synthetic", "--synthetic-samples", "512",
           "--epochs", "100000", "--eval-every", "1", "--ckpt-every-epoch"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**CLEAN, "PYTHONPATH": os.path.join(ROOT, "src")}, cwd=out)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout))
    reader.start()
    time.sleep(minutes * 60)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join()
    epochs = sum(line.startswith("epoch ") for line in lines)  # each evaluated and saved
    return {"minutes": minutes, "epochs": epochs, "stall_reports": sum(STUCK in l for l in lines),
            "straggler_lines": sum("straggler" in l for l in lines),
            "reports": [_with_stack(lines, i) for i, l in enumerate(lines) if STUCK in l][:5]}


def _with_stack(lines: list, i: int) -> str:
    """A report line and the stack lines under it (indented), as one string."""
    stack = []
    for line in lines[i + 1:i + 12]:
        if not line.startswith("    "):
            break
        stack.append(line.strip())
    return " | ".join([lines[i].strip(), *stack])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=0)
    p.add_argument("--nodes", type=int, choices=(1, 3), default=1)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--false-alarm-minutes", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    faults = args.faults.split(",")
    results = {"trials": [], "false_alarms": None, "nodes": args.nodes}
    for trial in range(args.trials):
        fault, at = faults[trial % len(faults)], rng.randrange(20, 50)
        with tempfile.TemporaryDirectory() as out:
            r = (one_node if args.nodes == 1 else three_nodes)(fault, at, out)
        results["trials"].append(r)
        print(f"trial {trial + 1:2d} {fault:5s} at step {at}: named after {r['named_after']} s "
              f"({r['reports']} report{'s' if r['reports'] != 1 else ''}, "
              f"{'with' if ' | ' in r['line'] else 'without'} its stack)", flush=True)
    named = sorted(r["named_after"] for r in results["trials"] if r["named_after"] is not None)
    if results["trials"]:
        print(f"{args.nodes} node(s): {len(named)} of {len(results['trials'])} named; within 10 s: "
              f"{sum(t < 10 for t in named)}; median {named[len(named) // 2] if named else '-'} s, "
              f"min {named[0] if named else '-'} s, max {named[-1] if named else '-'} s")
    if args.false_alarm_minutes:
        with tempfile.TemporaryDirectory() as out:
            results["false_alarms"] = false_alarms(args.false_alarm_minutes, out)
        print("false alarms:", json.dumps(results["false_alarms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
