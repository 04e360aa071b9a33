"""A script that keeps its own training loop, shaped like real ones, with exact resume by
``rt.checkpointer``: augmentation that draws from the global RNGs (torch, random, NumPy) in
``__getitem__``, DataLoader workers, dropout, a per-step schedule, gradient accumulation with
``no_sync``, evaluation in the middle of training, and a per-sample ledger.

Run by tests/test_own_loop.py under `ddpkit run` (also with --max-restarts and a kill -9):

    ddpkit run --nproc 2 --max-restarts 1 tests/own_loop_script.py --out DIR --workers 2 \\
        --kill-rank 1 --kill-step 7
    ddpkit run --nproc 2 tests/own_loop_script.py --out DIR --fit     # the same under ddpkit.fit
"""
import argparse
import contextlib
import json
import os
import random
import signal
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

import ddpkit

SAMPLES, FEATURES, CLASSES = 91, 8, 3  # 91 on 2 ranks: one sample padded, a short last batch


class Augmented(Dataset):
    """Fixed data, augmented in __getitem__ from the global RNGs, like torchvision transforms."""

    def __init__(self, n=SAMPLES, seed=123):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i] + 0.1 * torch.rand(FEATURES)             # torch's global RNG
        if random.random() < 0.5:                              # Python's
            x = x.flip(0)
        x = x * float(np.random.uniform(0.9, 1.1))             # NumPy's
        return x, self.y[i], i


class Ledger:
    """Per rank and attempt: where the run started, then every batch's sample indices."""

    def __init__(self, out, rank, attempt, world, start):
        name = f"ledger-r{rank}-a{attempt}-w{world}.jsonl"
        self.file = open(os.path.join(out, name), "w", buffering=1)
        self.write({"start": list(start), "t": time.time()})

    def write(self, record):
        self.file.write(json.dumps(record) + "\n")
        os.fsync(self.file.fileno())


def build(rt, hidden=32):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(0.2),
                        nn.Linear(hidden, CLASSES))
    model = rt.wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    return model, opt, sched


def own_loop(rt, args):
    model, opt, sched = build(rt, args.hidden)
    loader = rt.loader(Augmented(), batch_size=args.batch, seed=7, num_workers=args.workers)
    val_set = Augmented(n=40, seed=5)
    ckpt = rt.checkpointer(os.path.join(args.out, "ckpt"), model=model, optimizer=opt,
                           scheduler=sched, loader=loader, every_steps=args.every, keep=2,
                           extra={"evals": []}, async_save=args.async_save)
    ledger = Ledger(args.out, rt.rank, ckpt.global_step if args.ledger_by_step else
                    attempt(rt, args), rt.world_size,
                    (ckpt.epoch, loader.state_dict()["samples_done"]))
    for epoch in range(ckpt.epoch, args.epochs):
        loader.set_epoch(epoch)  # as scripts written for DistributedSampler do: harmless here
        model.train()
        for i, (x, y, idx) in enumerate(loader):
            ledger.write({"epoch": loader.epoch, "pos": loader.state_dict()["samples_done"],
                          "idx": idx.tolist()})
            x, y = rt.to_device(x, y)
            last = (i + 1) % args.accum == 0 or loader.at_last_batch
            with contextlib.nullcontext() if last or args.accum == 1 else model.no_sync():
                loss = nn.functional.cross_entropy(model(x), y) / args.accum
                loss.backward()
            if not last:
                continue
            opt.step()
            opt.zero_grad()
            sched.step()
            ckpt.step()
            if args.log_to is not None:  # after the step's save: a kill next is the hard case
                rt.log({"train/loss": rt.mean(loss), "lr": sched.get_last_lr()[0]})
            maybe_kill(rt, args, ckpt.global_step)
            if args.eval_every and ckpt.global_step % args.eval_every == 0:
                ckpt.extra["evals"].append(rt.evaluate(model, val_set, topk=(1,))["loss"])
                if args.log_to is not None:
                    rt.log({"eval/loss": ckpt.extra["evals"][-1]})
                model.train()
    ckpt.close()
    return model, ckpt.global_step, ckpt.extra["evals"]


def attempt(rt, args):
    return rt.env.restart_count if args.attempt is None else args.attempt


def maybe_kill(rt, args, step):
    if attempt(rt, args) == 0 and rt.rank == args.kill_rank and step == args.kill_step:
        if args.kill_delay:  # later, wherever the run then is (e.g. inside a background write)
            import threading
            threading.Timer(args.kill_delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return
        os.kill(os.getpid(), getattr(signal, args.signal))
        if args.signal != "SIGKILL":
            time.sleep(0.5)  # let the handler run before the next step polls


class _LedgerHook(ddpkit.Hook):
    def __init__(self, args):
        self.args, self.ledger = args, None

    def on_fit_start(self, loop):
        self.ledger = Ledger(self.args.out, loop.rt.rank, attempt(loop.rt, self.args),
                             loop.rt.world_size, loop.start_position)

    def on_batch_end(self, loop, batch):
        self.ledger.write({"epoch": loop.loader.epoch,
                           "pos": loop.loader.state_dict()["samples_done"],
                           "idx": batch[2].tolist()})

    def on_step_end(self, loop, metrics):
        maybe_kill(loop.rt, self.args, loop.state.step)


def with_fit(rt, args):
    model, opt, sched = build(rt, args.hidden)
    loader = rt.loader(Augmented(), batch_size=args.batch, seed=7, num_workers=args.workers)
    state = ddpkit.fit(
        rt, model, opt, loader, epochs=args.epochs, scheduler=sched, scheduler_interval="step",
        accum_steps=args.accum, progress=False, hooks=[_LedgerHook(args)],
        step=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        checkpoint=ddpkit.CheckpointPolicy(os.path.join(args.out, "ckpt"),
                                           every_steps=args.every, keep=2, resume="auto",
                                           async_save=args.async_save))
    return model, state.step, []


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--every", type=int, default=3, help="checkpoint every N optimizer steps")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--signal", default="SIGKILL")
    p.add_argument("--kill-delay", type=float, default=0.0, help="SIGKILL this many s later")
    p.add_argument("--hidden", type=int, default=32, help="hidden width (larger: longer saves)")
    p.add_argument("--attempt", type=int, default=None, help="default: the restart count")
    p.add_argument("--fit", action="store_true", help="train with ddpkit.fit instead")
    p.add_argument("--async-save", action="store_true", help="checkpoints written in the background")
    p.add_argument("--engine", default="auto", help="ddp (auto) or fsdp")
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--ledger-by-step", action="store_true",
                   help="name each round's ledger by the step it resumed from, not the restart "
                        "count (a replaced node's launcher counts its restarts from 0)")
    p.add_argument("--backend", default=None, help="process group backend (gloo: ranks share a GPU)")
    p.add_argument("--adopt", choices=("accelerate", "fabric"), default=None,
                   help="make the process group with Accelerate's Accelerator or Lightning "
                        "Fabric's launcher first (Fabric starts the 2 processes itself)")
    p.add_argument("--log-to", default=None,
                   help="rt.log each step's loss and each evaluation to OUT/log/metrics.jsonl "
                        "and these trackers (comma-separated; '' for the JSONL alone)")
    return p


def adopt(how):
    """A script that mixes: Accelerate or Lightning Fabric made the group, ddpkit adopts it."""
    if how == "accelerate":
        from accelerate import Accelerator
        return Accelerator(cpu=True)
    if how == "fabric":
        from lightning.fabric import Fabric
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()  # starts the other process (this script again) and makes the group
        return fabric
    return None


def main():
    args = parser().parse_args()
    adopted = adopt(args.adopt)  # noqa: F841 (kept alive: it owns the group)
    logging = {} if args.log_to is None else {
        "log_to": args.log_to, "log_dir": os.path.join(args.out, "log"), "project": "own-loop"}
    rt = ddpkit.setup(seed=0, deterministic=True, engine=args.engine, backend=args.backend,
                      **logging)
    model, steps, evals = (with_fit if args.fit else own_loop)(rt, args)
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
              for p in rt.unwrap(model).parameters()]  # FSDP: every rank gathers the shards
    if rt.is_main:
        torch.save({"params": params, "step": steps, "evals": evals},
                   os.path.join(args.out, "final.pt"))
    rt.shutdown()


if __name__ == "__main__":
    main()
