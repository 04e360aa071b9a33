"""A small DDP loop in which one rank misbehaves at one step, for tests/test_stall.py:

    ddpkit run --nproc 2 tests/stall_script.py --fault loop --rank 1 --at 30

Faults that should be named (the others wait): ``loop`` (an infinite loop in the script),
``lock`` (a deadlock on a lock), ``read`` (a read that never returns: a FIFO no one writes, as
a dead NFS mount), ``stop`` (the script SIGSTOPs itself). Work that should not (the others
wait, but the rank is busy): ``eval`` (rank ``--rank`` evaluates alone, in its own loop, for
``--seconds``), ``save`` (a checkpoint save through ddpkit whose write takes ``--seconds``),
``loader`` (a DataLoader whose worker takes ``--seconds`` to start),
``straggler`` (every step of ``--rank`` takes 3x as long), ``compile`` (``--rank`` compiles
its model with ``torch.compile``: its first step takes long). And ``alone``: ``--rank`` runs a
collective (an evaluation) that the others skip, as under ``if rt.is_main:``: every rank waits.

Prints ``fault at <time.time()>`` the moment the fault begins (flushed), then ``done`` at the
end of a run that finishes.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit


def work(seconds: float) -> None:
    """Busy, real work for ``seconds``: forwards of a model (what an evaluation does)."""
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    end = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            net(torch.randn(256, 64))


def fault(kind: str, seconds: float, out: str) -> None:
    print(f"fault at {time.time():.3f}", flush=True)
    if kind == "loop":
        n = 0
        while True:
            n = (n + 1) % 7
    elif kind == "lock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    elif kind == "read":
        path = os.path.join(out, "dead-mount")
        os.mkfifo(path)
        with open(path) as f:   # blocks: nothing ever opens it for writing
            f.read()
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "eval":
        work(seconds)
    elif kind == "loader":   # a new epoch's DataLoader whose worker takes long to start
        data = torch.utils.data.TensorDataset(torch.randn(8, 32))
        loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1,
                                             worker_init_fn=lambda _: time.sleep(seconds))
        for _ in loader:
            pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fault", required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--at", type=int, default=30)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--out", default=".")
    args = p.parse_args()

    rt = ddpkit.setup(seed=0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    if args.fault == "compile" and rt.rank == args.rank:   # its first step compiles: slow
        print(f"fault at {time.time():.3f}", flush=True)
    model = rt.wrap(net, compile=args.fault == "compile" and rt.rank == args.rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = None
    if args.fault == "save":
        ckpt = rt.checkpointer(os.path.join(args.out, "ckpt"), model=model,
                               optimizer=optimizer, every_epoch=False, resume=None)
    for step in range(1, args.steps + 1):
        x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
        began = time.monotonic()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.fault == "straggler" and rt.rank == args.rank:
            work(2 * (time.monotonic() - began) + 0.02)    # 3x the step (and its sleep)
        else:
            time.sleep(0.01)
        if step == args.at:
            if args.fault == "save":
                slow_save(ckpt, args.seconds if rt.rank == args.rank else 0.0)
            elif args.fault == "alone":   # a collective on one rank only: never completes
                if rt.rank == args.rank:
                    print(f"fault at {time.time():.3f}", flush=True)
                    rt.evaluate(model, torch.utils.data.TensorDataset(
                        torch.randn(16, 32), torch.randint(0, 4, (16,))), batch_size=8)
                rt.barrier()
            elif rt.rank == args.rank:
                fault(args.fault, args.seconds, args.out)
            if args.fault in ("eval", "loader"):
                rt.barrier()
    print("done", flush=True)


def slow_save(ckpt, seconds: float) -> None:
    """ddpkit's checkpoint save, its write on this rank ``seconds`` slower (a slow disk)."""
    real = os.fsync

    def slow_fsync(fd):
        time.sleep(seconds)
        real(fd)

    os.fsync = slow_fsync
    try:
        print(f"fault at {time.time():.3f}", flush=True)
        ckpt.save()
    finally:
        os.fsync = real


if __name__ == "__main__":
    main()
