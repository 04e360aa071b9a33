"""resume_script's deterministic job with a short collective timeout and slow steps, for faults.

Numerically identical to ``resume_script.train`` (same model, data, seeds); the sleep only gives
a test time to cut a link mid-training. Run by tests/test_multinode.py on every node:

    ddpkit run --nnodes 2 --rdzv-endpoint 10.213.0.1:29400 tests/multinode_script.py \
        --out SHARED_DIR --timeout-s 6 --step-sleep 0.3
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import time
from datetime import timedelta

import torch
from torch import nn

import ddpkit
from ddpkit.training.loop import CheckpointPolicy, Hook, fit
from resume_script import CLASSES, FEATURES, Indexed, Ledger


class RoundLedger(Ledger):
    """resume_script's ledger, one file per start position: the attempt number is the step the
    run resumed from, the same on every node (restart counts are per node and can differ)."""

    def on_fit_start(self, loop):
        self.attempt = loop.state.step
        super().on_fit_start(loop)


def rounds(out: str) -> dict:
    """{start step: rank 0's ledger records} for each run (round) of the job, in order; a line
    still being written is left out.

    Example::

        first, resumed = rounds(out).values()   # resumed[1]["t"]: when its first step ended
    """
    runs = {}
    for path in glob.glob(os.path.join(str(out), "ledger-r0-a*-w*.jsonl")):
        runs[int(re.search(r"-a(\d+)-w", path).group(1))] = ledger_records(path)
    return dict(sorted(runs.items()))


def ledger_records(path: str) -> list:
    """One ledger file's records; a line still being written is left out."""
    records = []
    for line in open(path):
        try:
            records.append(json.loads(line))
        except ValueError:  # the line the job is writing right now
            break
    return records


class Slow(Hook):
    """Sleeps after every step so that a run lasts long enough to be interrupted."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, loop, metrics):
        time.sleep(self.seconds)


def train(out: str, timeout_s: float, step_sleep: float, epochs: int = 3, batch: int = 8) -> None:
    """Train like resume_script.train(out, epochs, resume="auto"); rank 0 saves OUT/final.pt."""
    # env:// as every script: after a restart `ddpkit run` gives each rendezvous round a fresh
    # store (restart counts can differ between nodes), and ddpkit.env.dist then adds no prefix.
    rt = ddpkit.setup(seed=0, deterministic=True, timeout=timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = rt.wrap(nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    loader = rt.loader(Indexed(), batch_size=batch, seed=7)
    # The checkpoint directory must be shared by the nodes (as on a cluster file system).
    policy = CheckpointPolicy(os.path.join(out, "ckpt"), every_steps=2, keep=2, resume="auto")
    hooks = [RoundLedger(out, 0, -1, -1), Slow(step_sleep)]
    state = fit(rt, model, optimizer, loader, epochs=epochs, scheduler=scheduler,
                scheduler_interval="step", checkpoint=policy, hooks=hooks, progress=False,
                eval_data=None)
    if rt.is_main:
        params = [p.detach().clone() for p in rt.unwrap(model).parameters()]
        torch.save({"params": params, "step": state.step}, os.path.join(out, "final.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    args = p.parse_args()
    train(args.out, args.timeout_s, args.step_sleep, args.epochs, args.batch)


if __name__ == "__main__":
    main()
