"""A deterministic training job with a per-sample ledger and optional self-inflicted kill -9.

Run by tests/test_resume.py under `ddpkit run` (also with --max-restarts) and ddpkit.launch:

    ddpkit run --nproc 2 --max-restarts 2 tests/resume_script.py --out DIR --kill-rank 1 --kill-step 7
"""
import argparse
import json
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.training.loop import CheckpointPolicy, Hook, fit

SAMPLES, FEATURES, CLASSES = 96, 8, 3


class Indexed(Dataset):
    """Fixed random data that also returns each sample's index (for the ledger)."""

    def __init__(self):
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Ledger(Hook):
    """Appends, per rank and attempt, where the run started and every batch's sample indices."""

    def __init__(self, out, attempt, kill_rank, kill_step, signal=signal.SIGKILL):
        self.out, self.attempt = out, attempt
        self.kill_rank, self.kill_step, self.signal = kill_rank, kill_step, signal
        self.file = None

    def on_fit_start(self, loop):
        name = f"ledger-r{loop.rt.rank}-a{self.attempt}-w{loop.rt.world_size}.jsonl"
        self.file = open(os.path.join(self.out, name), "w", buffering=1)
        self.file.write(json.dumps({"start": list(loop.start_position), "t": time.time()}) + "\n")

    def on_batch_end(self, loop, batch):
        pos = loop.loader.state_dict()["samples_done"]
        self.file.write(json.dumps({"epoch": loop.loader.epoch, "pos": pos,
                                    "idx": batch[2].tolist(), "t": time.time()}) + "\n")
        os.fsync(self.file.fileno())

    def on_step_end(self, loop, metrics):
        if (self.attempt == 0 and loop.rt.rank == self.kill_rank
                and loop.state.step == self.kill_step):
            os.kill(os.getpid(), self.signal)  # SIGKILL: a real crash, no cleanup, no exception


def slow_checkpoint_fsync(seconds):
    """Each fsync of a checkpoint (its files and directory) takes ``seconds`` longer: a slow
    disk. Each one says so first on the writing rank, so a test can signal during a save."""
    real = os.fsync

    def slow(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "ckpt" in (os.path.basename(path), os.path.basename(os.path.dirname(path))):
            print(f"slow fsync of {os.path.basename(path)}", flush=True)
            time.sleep(seconds)
        real(fd)

    os.fsync = slow


def train(out, epochs=3, batch=8, resume=None, max_steps=None, kill_rank=-1, kill_step=-1,
          attempt=None, every_steps=2, kill_signal=signal.SIGKILL, backend=None, engine="auto"):
    rt = ddpkit.setup(seed=0, deterministic=True, backend=backend, engine=engine)
    attempt = rt.env.restart_count if attempt is None else attempt
    torch.manual_seed(0)
    model = rt.wrap(nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    loader = rt.loader(Indexed(), batch_size=batch, seed=7)
    policy = CheckpointPolicy(os.path.join(out, "ckpt"), every_steps=every_steps, keep=2,
                              resume=resume)
    state = fit(rt, model, optimizer, loader, epochs=epochs, scheduler=scheduler,
                scheduler_interval="step", checkpoint=policy, max_steps=max_steps,
                hooks=[Ledger(out, attempt, kill_rank, kill_step, kill_signal)], progress=False,
                eval_data=None)
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
              for p in rt.unwrap(model).parameters()]  # FSDP: gather the shards
    if rt.is_main:
        torch.save({"params": params, "step": state.step}, os.path.join(out, "final.pt"))
    return {"params": params, "step": state.step}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--signal", default="SIGKILL", help="what --kill-rank gets at --kill-step")
    p.add_argument("--backend", default=None, help="process group backend (gloo: ranks share a GPU)")
    p.add_argument("--engine", default="auto", help="ddp (auto), fsdp, ...")
    p.add_argument("--slow-fsync", type=float, default=0.0, help="seconds added to each fsync "
                   "of a checkpoint")
    args = p.parse_args()
    if args.slow_fsync:
        slow_checkpoint_fsync(args.slow_fsync)
    # Under --max-restarts a restarted worker must resume: "auto" starts fresh when there is none.
    train(args.out, epochs=args.epochs, resume="auto", kill_rank=args.kill_rank,
          kill_step=args.kill_step, kill_signal=getattr(signal, args.signal), backend=args.backend,
          engine=args.engine)


if __name__ == "__main__":
    main()
