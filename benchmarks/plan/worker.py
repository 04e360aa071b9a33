"""One rank of the plan validation: an MLP trained with DDP (and a comm hook) on synthetic data,
one thread; rank 0 prints the median step time (--steps at least, more where steps are short).
With ``--calibrate``, what the planner takes as measured instead: a step's compute (forward,
backward, the optimizer step; DDP over a process group of one rank) and each hook's own compute
on such a group, every rank at once and in step, so that ranks which share a host's cores
(namespaced nodes) are measured as they will run.

    ddpkit run --nnodes 2 --nproc 1 ... benchmarks/plan/worker.py --hook bf16 --steps 12
    ddpkit run --nnodes 2 --nproc 1 ... benchmarks/plan/worker.py --calibrate --hooks bf16,powersgd
"""
import argparse
import json
import os
import statistics
import time

import torch
from torch import nn

import ddpkit


def mlp(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    took = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


#: A cell's steps after --steps: as many as fit in WINDOW_S, at most MAX_STEPS in all.
WINDOW_S, MAX_STEPS = 3.0, 60

#: Seconds a hook is timed for (the median step kept): long next to the ranks' small drift.
HOOK_WINDOW_S = 2.0


def _in_step(work, count=40):
    """Median seconds of ``work`` run on every rank with a barrier after each time (as DDP's
    all-reduces hold the ranks together every step), the barrier included."""
    import torch.distributed as dist

    times = []
    dist.barrier()
    for _ in range(count):
        start = time.perf_counter()
        work()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[4:])


def calibrate(rt, model, x, y, hooks):
    """Compute and hook compute, measured on every rank at once and in step: every namespaced
    node runs on this host, so what a rank gets while the others compute is its device (3 ranks
    on 2 cores are not 3 devices: a rank alone, or a median over free-running ranks, would
    say 20 ms where lock-step DDP gets 30). Compute is a DDP step over a process group of one
    rank (its bucket copies and averaging run, its all-reduce costs nothing); each hook runs on
    such a group too. Rank 0 prints the slowest rank's figures as JSON, and the process ends
    there (``os._exit``: groups made here can be freed last by one of gloo's own threads, which
    aborts the process)."""
    import torch.distributed as dist

    from ddpkit.cost.measure import time_hooks, workload_of
    from ddpkit.engines.ddp import comm_hook_for
    from ddpkit.base.wrap import WrapOptions

    alone = [dist.new_group([r]) for r in range(rt.world_size)]   # every rank makes every group
    wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=alone[rt.rank])
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)

    def step():
        loss = nn.functional.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    idle_s = _in_step(lambda: None)   # a barrier alone, taken off what follows
    spent = {"compute": _slowest(max(_in_step(step) - idle_s, 0.0)), "none": 0.0}
    shapes = workload_of(model, spent["compute"], len(x)).bucket_shapes

    def make(name, r, group=None):
        return comm_hook_for(name, WrapOptions(powersgd_rank=r), group)

    for hook in [h for h in hooks if h != "none"]:
        guess = _slowest(time_hooks(shapes, [(hook, 2)], make, torch.device("cpu"),
                                    group=alone[rt.rank])[(hook, 2)])
        steps = max(5, round(HOOK_WINDOW_S / max(guess, 1e-6)))
        dist.barrier()
        seconds = time_hooks(shapes, [(hook, 2)], make, torch.device("cpu"),
                             group=alone[rt.rank], steps=steps, median=True,
                             after_step=dist.barrier)[(hook, 2)]
        spent[hook] = _slowest(max(seconds - idle_s, 0.0))
    if rt.is_main:
        print(json.dumps(spent), flush=True)
    dist.barrier()
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hook", default="none")
    p.add_argument("--steps", type=int, default=12,
                   help="steps at least (the first 4 not counted); short steps run more")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--calibrate", action="store_true",
                   help="measure compute and the hooks' compute instead of training")
    p.add_argument("--hooks", default="bf16,powersgd", help="hooks to time with --calibrate")
    args = p.parse_args()
    torch.set_num_threads(1)
    rt = ddpkit.setup(seed=0)
    model = mlp(args.width, args.depth)
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    if args.calibrate:
        calibrate(rt, model, x, y, args.hooks.split(","))
    wrapped = rt.wrap(model, comm_hook=None if args.hook == "none" else args.hook,
                      powersgd_start_iter=2)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    times = []

    def step():
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)

    for _ in range(args.steps):
        step()
    # more steps where they are short: a median of 3 steps of 40 ms moved by 30% between runs;
    # every rank runs as many (the slowest rank's step sets the count)
    more = int(min(MAX_STEPS - args.steps, WINDOW_S / max(_slowest(statistics.median(
        times[4:])), 1e-6)))
    for _ in range(max(more, 0)):
        step()
    measured = statistics.median(times[4:])
    if rt.is_main:
        print(json.dumps({"hook": args.hook, "step_s": measured, "params": sum(
            p.numel() for p in model.parameters())}), flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
