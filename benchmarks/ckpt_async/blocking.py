"""How long a checkpoint save blocks the training step: synchronous vs asynchronous saves
(issue 36, item 6), 2 ranks, DDP and FSDP, models of ~10M, ~100M and ~350M parameters.

    python benchmarks/ckpt_async/blocking.py --sizes 10 100 350 --engines ddp fsdp --rounds 3
    python benchmarks/ckpt_async/blocking.py --nproc 1     # on a GPU: one process per GPU, NCCL

Each model is a stack of Linear(2048, 2048) layers with SGD momentum (the optimizer state is as
large as the weights), trained 2 steps, then saved with two checkpointers of the same run (one
synchronous, one ``async_save=True``) in alternation A B A B, ``rounds`` times each. Blocking
time: the seconds ``ckpt.save()`` takes on rank 0 (the collective save every rank waits for);
for async saves the write in flight before is waited for first, outside the timing, and the
time until that write is on disk is reported as "write". On a GPU the model trains there and the
asynchronous snapshot is a device-to-host copy into pinned buffers. Prints one JSON line per row.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import ddpkit

WIDTH = 2048


def run(size_m: int, engine: str, rounds: int, root: str, backend=None) -> dict:
    rt = ddpkit.setup(engine=engine, backend=backend)
    layers = max(1, round(size_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    model = rt.wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(4, WIDTH, device=rt.device)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = sum(p.numel() for p in net.parameters())  # an FSDP shard (DTensor) counts whole
    sync = rt.checkpointer(os.path.join(root, "sync"), model=model, optimizer=opt, keep=1,
                           resume=None)
    background = rt.checkpointer(os.path.join(root, "async"), model=model, optimizer=opt,
                                 keep=1, resume=None, async_save=True)
    times = {"sync": [], "async": [], "write": []}
    for i in range(rounds + 1):     # round 0: warm-up (allocates the async host buffers)
        for name, ckpt in (("sync", sync), ("async", background)):
            background.wait()
            rt.barrier()
            began = time.perf_counter()
            ckpt.global_step = 10 * (i + 1)
            ckpt.save()
            blocked = time.perf_counter() - began
            if name == "async":
                background.wait()
                written = time.perf_counter() - began
                if i:
                    times["write"].append(written)
            if i:
                times[name].append(blocked)
    background.close()
    sync.close()
    row = {"engine": engine, "device": (torch.cuda.get_device_name(rt.device)
                                        if rt.device.type == "cuda" else "cpu"),
           "backend": rt.backend, "params_M": round(params / 1e6, 1), "ranks": rt.world_size,
           "sync_s": statistics.median(times["sync"]), "async_s": statistics.median(times["async"]),
           "async_write_s": statistics.median(times["write"]), "rounds": rounds}
    row["async_over_sync"] = row["async_s"] / row["sync_s"]
    return row if rt.is_main else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 350], help="millions")
    p.add_argument("--engines", nargs="+", default=["ddp", "fsdp"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2, help="ranks (on one GPU: 1, or 2 with gloo)")
    p.add_argument("--backend", default=None, help="default: NCCL on GPUs, gloo on CPUs")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    for size in args.sizes:
        for engine in args.engines:
            root = tempfile.mkdtemp(dir=args.dir, prefix="ckpt-async-")
            try:
                row = ddpkit.launch(run, args.nproc, size, engine, args.rounds, root,
                                    args.backend, timeout=1800)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
