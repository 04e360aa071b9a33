"""A user's own loop under ``ddpkit run --fault-tolerant`` (tests/test_live.py): augmentation
that draws from the global RNGs in ``__getitem__``, dropout, a per-step schedule, evaluation in
the middle of training, uneven shares (91 samples, a global batch of 8 over 3 replicas), and a
ledger per replica and attempt of every step it committed and the samples it counted.

    ddpkit run --fault-tolerant --nproc 3 tests/live_script.py --out DIR --kill-step 10
"""
import argparse
import json
import os
import signal
import time

import torch
from torch import nn

import ddpkit
# its data: augmentation that draws from the global RNGs in __getitem__, giving (x, y, index)
from own_loop_script import CLASSES, FEATURES, SAMPLES, Augmented

BATCH = 8


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--kill-step", type=int, default=-1)   # replica 1, first attempt: kill -9
    p.add_argument("--stop-step", type=int, default=-1)   # replica 1: SIGSTOP itself
    p.add_argument("--raise-step", type=int, default=-1)  # replica 1, every attempt: raise
    p.add_argument("--ckpt", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)  # a slower step, seconds
    p.add_argument("--async-save", action="store_true")
    args = p.parse_args()
    with ddpkit.setup() as rt:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(args.dropout),
                            nn.Linear(32, CLASSES))
        model = rt.wrap(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        loader = rt.loader(Augmented(), batch_size=BATCH, seed=7, num_workers=2)
        ckpt = rt.checkpointer(args.ckpt, model=model, optimizer=opt, scheduler=sched,
                               loader=loader, every_steps=5, extra={"evals": []},
                               async_save=args.async_save)
        # a replica's name under --fault-tolerant; a rank's under restart-based ddpkit run
        name = os.environ.get("DDPKIT_REPLICA_ID", f"rank{rt.rank}")
        attempt = rt.env.restart_count
        ledger = open(os.path.join(args.out, f"ledger-{name}-{attempt}.jsonl"), "w", buffering=1)
        ledger.write(json.dumps({"start": ckpt.global_step, "pid": os.getpid()}) + "\n")
        mine = name.endswith("-1")
        for epoch in range(ckpt.epoch, args.epochs):
            loader.set_epoch(epoch)
            model.train()
            for x, y, idx in loader:
                step = ckpt.global_step
                if mine and 0 <= args.raise_step <= step:
                    raise RuntimeError(f"a bug at step {step}")
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                ckpt.step()
                if ckpt.global_step == step + 1:  # committed
                    ledger.write(json.dumps({"step": step, "epoch": epoch,
                                             "idx": idx[:loader.last_counted].tolist()}) + "\n")
                if mine and attempt == 0 and ckpt.global_step == args.kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                if mine and attempt == 0 and ckpt.global_step == args.stop_step:
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(args.step_sleep)
                if ckpt.global_step % 10 == 0:  # evaluation in the middle of training
                    ckpt.extra["evals"].append(rt.evaluate(model, Augmented(40, 5))["loss"])
                    model.train()
        ckpt.close()
        flat = torch.cat([q.detach().flatten() for q in rt.unwrap(model).parameters()])
        ledger.write(json.dumps({"end": ckpt.global_step, "params": flat.tolist(),
                                 "lr": sched.get_last_lr()[0],
                                 "evals": ckpt.extra["evals"]}) + "\n")


if __name__ == "__main__":
    main()
