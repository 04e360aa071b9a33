"""Predicted against measured DDP step time on two namespaced nodes (tests/netns.py) behind links
shaped with tc tbf, for each comm hook: the check behind issue 24's 15% bound. Root only.

    python benchmarks/plan/validate.py --rates none,1gbit,100mbit,10mbit --hooks none,bf16,powersgd

Compute is measured alone (one process, one thread, the same MLP and batch); the link is the
named one (line rate x 0.94, 50 us) or, unshaped, what ddpkit doctor measures between the nodes.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from netns import Cluster  # noqa: E402

from ddpkit.plan.cost import LINKS, Link  # noqa: E402
from ddpkit.plan.predict import measure_flops, measure_hook, predict, workload_of  # noqa: E402

sys.path.insert(0, HERE)
from worker import mlp  # noqa: E402


def compute_alone(width, depth, batch, repeats=7):
    torch.set_num_threads(1)
    model = mlp(width, depth)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad()
    return statistics.median(times[2:]), model


def run_cell(rate, hook, args, port):
    with Cluster(2) as c:
        if rate != "none":
            for i in range(2):
                c.shape(i, rate)
        for i in range(2):
            c.start(i, [sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "--nproc", "1",
                        "--node-rank", str(i), "--rdzv-endpoint", f"{c.ip(0)}:{port}",
                        os.path.join(HERE, "worker.py"), "--hook", hook, "--steps",
                        str(args.steps), "--width", str(args.width), "--depth", str(args.depth),
                        "--batch", str(args.batch)], cwd=ROOT)
        codes = c.wait(timeout=600)
        if codes != [0, 0]:
            raise SystemExit(f"cell {rate}/{hook} failed: {c.tails()}")
        line = next(l for l in c.output(0).splitlines() if l.startswith("{"))
    return json.loads(line)["step_s"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="none,1gbit,100mbit,10mbit")
    p.add_argument("--hooks", default="none,bf16,powersgd")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--unshaped-link", default="10gbit", help="the link assumed when unshaped")
    args = p.parse_args()
    compute, model = compute_alone(args.width, args.depth, args.batch)
    work = workload_of(model, compute, args.batch, f"mlp {args.width}x{args.depth}")
    torch.set_num_threads(1)
    flops = measure_flops()
    hooks = {h: measure_hook(work, h) for h in args.hooks.split(",")}
    print("hook compute measured alone: " + ", ".join(f"{h} {s * 1e3:.1f} ms"
                                                     for h, s in hooks.items()))
    print(f"compute alone {compute * 1e3:.1f} ms, {work.params:,} parameters, "
          f"{flops / 1e9:.1f} Gflop/s (1 thread)")
    print(f"{'link':>8} {'hook':>8} {'predicted ms':>13} {'measured ms':>12} {'error':>7}")
    port = 29600
    for rate in args.rates.split(","):
        link: Link = LINKS[rate if rate != "none" else args.unshaped_link]
        for hook in args.hooks.split(","):
            port += 1
            measured = run_cell(rate, hook, args, port)
            predicted = predict(work, [2], link, hooks=[hook], flops_per_s=flops,
                                hook_seconds=hooks)[0].step.total
            print(f"{rate:>8} {hook:>8} {predicted * 1e3:>13.1f} {measured * 1e3:>12.1f} "
                  f"{predicted / measured - 1:>+7.0%}", flush=True)


if __name__ == "__main__":
    main()
