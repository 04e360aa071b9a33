"""kill -9 at random moments with asynchronous checkpoints every few steps (issue 36, item 8):
every resume loads a complete checkpoint and the run ends bitwise equal to the uninterrupted one.

    python benchmarks/ckpt_async/kill_trials.py --trials 50 --seed 0

The run is tests/own_loop_script.py (2 ranks under `ddpkit run --max-restarts 1`: augmentation
from the global RNGs, dropout, a schedule, evaluation every 4 steps) with a hidden layer of
``--hidden`` units (100,000: ~1.3M parameters, a 16 MB checkpoint with momentum, so each
background write lasts tens of ms) and ``async_save`` every 2 steps. Each trial SIGKILLs a
random rank a random 0-60 ms after a random step: inside a background write, between writes,
during the snapshot, wherever the run is then. Checked per trial: exit 0, the resume (or a start
afresh when no checkpoint was complete yet) ends bitwise equal to the reference, and every
sample of every epoch trained exactly once (the ledger). Prints one JSON line per trial and a
summary.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "..", "tests")
sys.path.insert(0, TESTS)

import own_loop_script  # noqa: E402
from test_resume import effective_samples  # noqa: E402

EPOCHS = 3


def run(out: str, flags: list) -> subprocess.CompletedProcess:
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", "--max-restarts", "1",
           os.path.join(TESTS, "own_loop_script.py"), "--out", out, "--epochs", str(EPOCHS),
           "--workers", "0", "--eval-every", "4", "--every", "2", "--async-save", *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def final(out: str) -> dict:
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def every_sample_once(out: str) -> bool:
    per_epoch = effective_samples(out)
    return sorted(per_epoch) == list(range(EPOCHS)) and all(
        sorted(set(idx)) == list(range(own_loop_script.SAMPLES)) and
        len(idx) == own_loop_script.SAMPLES + 1 for idx in per_epoch.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=100_000)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="kill-trials-")
    res = run(os.path.join(root, "ref"), ["--hidden", str(args.hidden)])
    assert res.returncode == 0, res.stderr[-3000:]
    reference = final(os.path.join(root, "ref"))
    rng = random.Random(args.seed)
    good = resumed = 0
    for trial in range(args.trials):
        rank, step = rng.randrange(2), rng.randrange(1, reference["step"])
        delay = round(rng.uniform(0.0, 0.06), 3)
        out = os.path.join(root, f"t{trial}")
        res = run(out, ["--hidden", str(args.hidden), "--kill-rank", str(rank),
                        "--kill-step", str(step), "--kill-delay", str(delay or 0.001)])
        text = res.stdout + res.stderr
        ok = res.returncode == 0 and os.path.exists(os.path.join(out, "final.pt"))
        equal = ok and final(out)["step"] == reference["step"] and all(
            torch.equal(a, b) for a, b in zip(final(out)["params"], reference["params"]))
        once = ok and every_sample_once(out)
        came_back = [line for line in text.splitlines() if line.startswith("resumed from")]
        resumed += bool(came_back)
        good += bool(equal and once)
        print(json.dumps({"trial": trial, "rank": rank, "step": step, "delay_s": delay,
                          "exit": res.returncode, "resumed_from": came_back[0].split()[2]
                          if came_back else None, "bitwise_equal": equal,
                          "every_sample_once": once}), flush=True)
        if not (equal and once):
            print(text[-3000:], file=sys.stderr)
    print(json.dumps({"trials": args.trials, "passed": good, "resumed": resumed,
                      "started_afresh": args.trials - resumed}), flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
