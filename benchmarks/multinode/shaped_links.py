"""ResNet-18 DDP on 2 "machines" (network namespaces) across tc-shaped links, with comm hooks.

Step time, images/s and efficiency per link speed and hook; then digits accuracy per hook (as root):

    /work/venv/bin/python benchmarks/multinode/shaped_links.py --out bench-out/multinode
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the namespace harness lives with the tests

RATES = ["unshaped", "10gbit", "1gbit", "100mbit"]
HOOKS = ["none", "fp16", "bf16", "powersgd1", "powersgd2", "powersgd4"]
PER_RANK_BATCH = 64


# ----------------------------------------------------------------------------- comm hooks

def register_hook(model: nn.Module, name: str, start_iter: int = 2) -> None:
    """Register ``name`` (none | fp16 | bf16 | powersgdR) on a DDP ``model``.

    Example::

        register_hook(ddp_model, "powersgd4")
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if name == "none":
        return
    if name in ("fp16", "bf16"):
        model.register_comm_hook(None, getattr(default, f"{name}_compress_hook"))
        return
    if not name.startswith("powersgd"):
        raise ValueError(f"unknown hook {name!r}; choose from {', '.join(HOOKS)}")
    # Same defaults as ddpkit's rt.wrap(comm_hook="powersgd") except the rank and start step.
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(name[8:]),
                               start_powerSGD_iter=start_iter)
    model.register_comm_hook(state, psgd.powerSGD_hook)


# ----------------------------------------------------------------------------- throughput worker

def _measure(rt: Any, hook: str, warmup: int, steps: int) -> Dict[str, float]:
    import ddpkit

    torch.manual_seed(0)
    model = rt.wrap(ddpkit.models.resnet18(num_classes=100))
    register_hook(model, hook, start_iter=max(1, warmup - 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randn(PER_RANK_BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, 100, (PER_RANK_BATCH,), generator=g)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            rt.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()  # DDP's all-reduce ends in here
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"hook": hook, "step_s": median, "images_s": rt.world_size * PER_RANK_BATCH / median,
            "steps": steps, "min_s": min(times), "max_s": max(times)}


def worker(args: argparse.Namespace) -> None:
    """One rank of the throughput job: every hook in turn, rank 0 writes the JSON."""
    import ddpkit

    torch.set_num_threads(1)
    rt = ddpkit.setup()
    results = []
    for hook in args.hooks:
        steps = args.slow_steps if args.rate == "100mbit" and hook == "none" else args.steps
        results.append(_measure(rt, hook, args.warmup, steps))
        rt.print(json.dumps(results[-1]))
    if rt.is_main:
        with open(args.json, "w") as f:
            json.dump({"rate": args.rate, "results": results}, f, indent=1)
    rt.shutdown()


# ----------------------------------------------------------------------------- orchestration

def run_rate(rate: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One 2-node job on links shaped to ``rate`` (both directions, both nodes)."""
    from netns import Cluster

    out = os.path.join(args.out, f"{rate}.json")
    cmd_tail = [__file__, "--worker", "--rate", rate, "--json", out, "--warmup",
                str(args.warmup), "--steps", str(args.steps), "--slow-steps",
                str(args.slow_steps), "--hooks", *args.hooks]
    with Cluster(2, workdir=os.path.join(args.out, f"logs-{rate}")) as c:
        for i in range(2):
            if rate != "unshaped":
                c.shape(i, rate)
        for i in range(2):
            c.start(i, [sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "--nproc", "1",
                        "--rdzv-endpoint", f"{c.ip(0)}:29400", "--iface", c.iface, *cmd_tail],
                    env={"OMP_NUM_THREADS": "1"}, cwd=ROOT)
        codes = c.wait(timeout=args.timeout)
        if codes != [0, 0]:
            raise RuntimeError(f"rate {rate}: exit codes {codes}\n{c.tails(30)}")
    with open(out) as f:
        return json.load(f)


def throughput_table(runs: List[Dict[str, Any]]) -> str:
    """Markdown: step time, images/s and efficiency vs unshaped uncompressed."""
    base = next(r["images_s"] for run in runs if run["rate"] == "unshaped"
                for r in run["results"] if r["hook"] == "none")
    lines = ["| link | hook | step (median s) | images/s | efficiency |", "|---|---|---|---|---|"]
    for run in runs:
        for r in run["results"]:
            lines.append(f"| {run['rate']} | {r['hook']} | {r['step_s']:.2f} | "
                         f"{r['images_s']:.1f} | {r['images_s'] / base:.2f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- accuracy

def accuracy_worker(hook: str, seed: int, epochs: int) -> float:
    """small_cnn on the embedded digits, 2 ranks, global batch 64: test top-1 after ``epochs``."""
    import ddpkit
    from ddpkit.datasets import digits
    from ddpkit.models import build_model

    torch.set_num_threads(1)
    rt = ddpkit.setup(seed=seed)
    train_set, test_set = digits(train=True), digits(train=False)
    model = rt.wrap(build_model("small_cnn", 10, 1))
    register_hook(model, hook, start_iter=10)  # PowerSGD's usual vanilla warm-up
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    loader = rt.loader(train_set, batch_size=64, seed=seed)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=epochs * len(loader))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
    return float(rt.evaluate(model, test_set)["top1"])


def accuracy(hooks: List[str], seeds: int, epochs: int) -> Dict[str, List[float]]:
    """Test accuracy per hook over ``seeds`` seeds (ddpkit.launch, loopback: no shaping)."""
    import ddpkit

    return {h: [ddpkit.launch(accuracy_worker, 2, h, s, epochs, timeout=600) for s in range(seeds)]
            for h in hooks}


def accuracy_table(acc: Dict[str, List[float]]) -> str:
    lines = ["| hook | test top-1 per seed (%) | mean | vs none (points) |", "|---|---|---|---|"]
    base = statistics.mean(acc["none"])
    for hook, values in acc.items():
        mean = statistics.mean(values)
        lines.append(f"| {hook} | {', '.join(f'{v:.2f}' for v in values)} | {mean:.2f} | "
                     f"{mean - base:+.2f} |")
    return "\n".join(lines)


def best_hook_at(runs: List[Dict[str, Any]], rate: str) -> Optional[str]:
    """The compressing hook with the highest images/s on ``rate`` links."""
    run = next((r for r in runs if r["rate"] == rate), None)
    if run is None:
        return None
    hooks = [r for r in run["results"] if r["hook"] != "none"]
    return max(hooks, key=lambda r: r["images_s"])["hook"] if hooks else None


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-out/multinode")
    p.add_argument("--rates", nargs="+", default=RATES, choices=RATES)
    p.add_argument("--hooks", nargs="+", default=HOOKS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--slow-steps", type=int, default=4, help="steps for fp32 at 100 Mbit/s")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per link speed")
    p.add_argument("--accuracy-seeds", type=int, default=3)
    p.add_argument("--accuracy-epochs", type=int, default=12)
    p.add_argument("--accuracy-hooks", nargs="*", help="default: none + the best at 100mbit")
    p.add_argument("--skip-throughput", action="store_true")
    # worker side (started by ddpkit run inside each node)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rate", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    runs: List[Dict[str, Any]] = []
    if not args.skip_throughput:
        for rate in args.rates:
            started = time.monotonic()
            runs.append(run_rate(rate, args))
            print(f"{rate}: {time.monotonic() - started:.0f} s", flush=True)
        print(throughput_table(runs), flush=True)
    else:
        for rate in args.rates:
            with open(os.path.join(args.out, f"{rate}.json")) as f:
                runs.append(json.load(f))
    hooks = args.accuracy_hooks
    if hooks is None:
        hooks = ["none"] + [h for h in [best_hook_at(runs, "100mbit")] if h]
    if hooks:
        acc = accuracy(hooks, args.accuracy_seeds, args.accuracy_epochs)
        with open(os.path.join(args.out, "accuracy.json"), "w") as f:
            json.dump(acc, f, indent=1)
        print(accuracy_table(acc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
