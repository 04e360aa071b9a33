"""kill -9 at random moments with asynchronous checkpoints every few steps (issue 36, item 8;
issue 55: FSDP, and a node lost on 3 namespaced nodes): every resume loads a complete checkpoint
and the run ends bitwise equal to the uninterrupted one.

    python benchmarks/ckpt_async/kill_trials.py --trials 50 --seed 0
    python benchmarks/ckpt_async/kill_trials.py --trials 10 --engine fsdp
    sudo python benchmarks/ckpt_async/kill_trials.py --trials 10 --nodes 3    # root: namespaces

The run is tests/own_loop_script.py (under `ddpkit run --max-restarts 1`: augmentation from the
global RNGs, dropout, a schedule, evaluation every 4 steps) with a hidden layer of ``--hidden``
units (100,000: ~1.3M parameters, a 16 MB checkpoint with momentum, so each background write
lasts tens of ms) and ``async_save`` every 2 steps. On one node (2 ranks, ``--engine`` ddp or
fsdp) each trial SIGKILLs a random rank a random 0-60 ms after a random step: inside a
background write, between writes, during the snapshot, wherever the run is then. With
``--nodes 3`` (one rank a node, global batch 12) each trial kills a whole node (its launcher
and its rank, kill -9, as a machine dies) at a random moment of training, node 1 or 2 (node 0
holds the rendezvous), and starts its launcher again a second later (as Slurm or Kubernetes
would): the survivors' launchers restart their ranks, the new node joins, all resume from the
newest complete checkpoint. Checked per trial: exit 0 on every node, the resume (or a start
afresh when no checkpoint was complete yet) ends bitwise equal to the reference (the same job
uninterrupted, as many ranks on one node), and every sample of every epoch trained exactly
once (the ledger). Prints one JSON line per trial and a summary.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "..", "tests")
sys.path.insert(0, TESTS)

import own_loop_script  # noqa: E402
from test_resume import effective_samples  # noqa: E402

EPOCHS = 3
PORT = 29400


def script_args(out: str, args: argparse.Namespace) -> list:
    return [os.path.join(TESTS, "own_loop_script.py"), "--out", out, "--epochs", str(EPOCHS),
            "--workers", "0", "--eval-every", "4", "--every", "2", "--async-save",
            "--hidden", str(args.hidden), "--engine", args.engine,
            "--batch", str(12 if args.nodes > 1 else 8)]


def run(out: str, args: argparse.Namespace, flags: list = (), nproc: int = 2) -> \
        subprocess.CompletedProcess:
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", str(nproc), "--max-restarts", "1",
           *script_args(out, args), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def final(out: str) -> dict:
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def every_sample_once(out: str, world: int) -> bool:
    per_epoch = effective_samples(out)
    padded = -(-own_loop_script.SAMPLES // world) * world
    return sorted(per_epoch) == list(range(EPOCHS)) and all(
        sorted(set(idx)) == list(range(own_loop_script.SAMPLES)) and len(idx) == padded
        for idx in per_epoch.values())


def node_trial(out: str, args: argparse.Namespace, rng: random.Random, steps: int) -> dict:
    """3 namespaced nodes; one (1 or 2) killed a random 0-0.3 s after rank 0 began a random
    batch (of ``steps``), and started again 1 s later."""
    from netns import Cluster

    os.makedirs(out)
    with Cluster(3, workdir=os.path.join(out, "nodes")) as c:
        cmd = [sys.executable, "-m", "ddpkit", "run", "--nnodes", "3", "--nproc", "1",
               "--rdzv-endpoint", f"{c.ip(0)}:{PORT}", "--max-restarts", "1",
               *script_args(out, args), "--ledger-by-step"]
        root = os.path.dirname(TESTS)
        for node in range(3):
            c.start(node, cmd, cwd=root)
        # not in the last 4 batches: the survivors could finish before the node is back, and
        # its launcher would find no job to join
        batch, delay = rng.randrange(1, steps - 4), round(rng.uniform(0.0, 0.3), 3)
        victim = rng.choice([1, 2])
        c.wait_for(lambda: any(len(open(p).readlines()) > batch for p in glob.glob(
            os.path.join(out, "ledger-r0-*.jsonl"))), 300, f"batch {batch}")
        time.sleep(delay)    # then wherever the run is: a step, a background write, a save
        writing = [n for n in os.listdir(os.path.join(out, "ckpt"))
                   if ".tmp" in n or n.startswith(".")] if os.path.isdir(
            os.path.join(out, "ckpt")) else []
        c.kill(victim)
        time.sleep(1.0)
        c.start(victim, cmd, cwd=root)
        codes = c.wait(timeout=600)
        text = "".join(c.output(n) for n in range(3))
    return {"node": victim, "batch": batch, "delay_s": delay, "writing": bool(writing),
            "codes": codes,
            "text": text}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=100_000)
    p.add_argument("--engine", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--nodes", type=int, default=1, choices=(1, 3))
    p.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = p.parse_args()
    world = 3 if args.nodes == 3 else 2
    root = tempfile.mkdtemp(prefix="kill-trials-")
    res = run(os.path.join(root, "ref"), args, nproc=world)
    assert res.returncode == 0, res.stderr[-3000:]
    reference = final(os.path.join(root, "ref"))
    rng = random.Random(args.seed)
    good = resumed = 0
    for trial in range(args.trials):
        out = os.path.join(root, f"t{trial}")
        if args.nodes == 3:
            got = node_trial(out, args, rng, reference["step"])
            record = {k: got[k] for k in ("node", "batch", "delay_s", "writing", "codes")}
            text, ok = got["text"], all(code == 0 for code in got["codes"])
        else:
            rank, step = rng.randrange(2), rng.randrange(1, reference["step"])
            delay = round(rng.uniform(0.0, 0.06), 3)
            res = run(out, args, ["--kill-rank", str(rank), "--kill-step", str(step),
                                  "--kill-delay", str(delay or 0.001)])
            record = {"rank": rank, "step": step, "delay_s": delay, "exit": res.returncode}
            text, ok = res.stdout + res.stderr, res.returncode == 0
        ok = ok and os.path.exists(os.path.join(out, "final.pt"))
        equal = ok and final(out)["step"] == reference["step"] and all(
            torch.equal(a, b) for a, b in zip(final(out)["params"], reference["params"]))
        once = ok and every_sample_once(out, world)
        came_back = [line for line in text.splitlines() if line.startswith("resumed from")]
        resumed += bool(came_back)
        good += bool(equal and once)
        print(json.dumps({"trial": trial, **record, "resumed_from": came_back[0].split()[2]
                          if came_back else None, "bitwise_equal": equal,
                          "every_sample_once": once}), flush=True)
        if not (equal and once):
            print(text[-3000:], file=sys.stderr)
            if ok:
                print(json.dumps({"evals": final(out)["evals"],
                                  "reference": reference["evals"]}), file=sys.stderr)
    print(json.dumps({"trials": args.trials, "engine": args.engine, "nodes": args.nodes,
                      "passed": good, "resumed": resumed,
                      "started_afresh": args.trials - resumed}), flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
