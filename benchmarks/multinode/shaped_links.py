"""ResNet-18 DDP on 2 "machines" (network namespaces) across tc-shaped links, with comm hooks.

Step time, images/s and efficiency per link speed and hook; then digits accuracy per hook. As root:

    /work/venv/bin/python benchmarks/multinode/shaped_links.py --out bench-out/multinode
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the namespace harness lives with the tests

RATES = ["unshaped", "10gbit", "1gbit", "100mbit"]
HOOKS = ["none", "fp16", "bf16", "powersgd1", "powersgd2", "powersgd4"]
PER_RANK_BATCH = 64


# ----------------------------------------------------------------------------- comm hooks

from ddpkit.engines.ddp import bf16_compress_any_backend as bf16_any_backend_hook  # noqa: E402


def register_hook(model: nn.Module, name: str, start_iter: int = 2) -> None:
    """Register ``name`` (none | fp16 | bf16 | powersgdR) on a DDP ``model``.

    Example::

        register_hook(ddp_model, "powersgd4")
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if name == "none":
        return
    if name == "fp16":
        model.register_comm_hook(None, default.fp16_compress_hook)
        return
    if name == "bf16":  # torch's bf16_compress_hook insists on NCCL; gloo reduces bf16 fine
        model.register_comm_hook(None, bf16_any_backend_hook)
        return
    if not name.startswith("powersgd"):
        raise ValueError(f"unknown hook {name!r}; choose from {', '.join(HOOKS)}")
    # Same defaults as ddpkit's rt.wrap(comm_hook="powersgd") except the rank and start step.
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(name[8:]),
                               start_powerSGD_iter=start_iter)
    model.register_comm_hook(state, psgd.powerSGD_hook)


# ----------------------------------------------------------------------------- throughput worker

def _request_rate(rt: Any, rate: str, sync_dir: str, seq: int) -> None:
    """Rank 0 asks the orchestrator (outside the namespaces) to shape the links, waits for it."""
    if rt.is_main:
        with open(os.path.join(sync_dir, f"want-{seq}"), "w") as f:
            f.write(rate)
        while not os.path.exists(os.path.join(sync_dir, f"ok-{seq}")):
            time.sleep(0.2)
    rt.barrier()


def _step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, sync: bool) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with contextlib.nullcontext() if sync else model.no_sync():
        nn.functional.cross_entropy(model(x), y).backward()  # DDP's all-reduce ends in here
    opt.step()
    return time.perf_counter() - start


def _cell(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor,
          args: argparse.Namespace) -> Tuple[List[float], List[float]]:
    """(synced step times, no-sync step times), alternating: the no-sync steps are this cell's
    own compute-only yardstick, taken under the same load from other jobs."""
    for _ in range(args.warmup):
        _step(model, opt, x, y, True)
    synced, local = [], []
    for _ in range(args.steps):
        local.append(_step(model, opt, x, y, False))
        synced.append(_step(model, opt, x, y, True))
    return synced, local


def worker(args: argparse.Namespace) -> None:
    """One rank: a DDP model per hook (built once, unshaped), then rounds over link speeds and
    hooks, interleaved so that load from other jobs on the machine hits every cell alike."""
    import ddpkit
    from ddpkit.job.models import resnet18

    torch.set_num_threads(1)
    rt = ddpkit.setup()
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randn(PER_RANK_BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, 100, (PER_RANK_BATCH,), generator=g)
    models = {}
    for hook in args.hooks:
        torch.manual_seed(0)
        model = rt.wrap(resnet18(num_classes=100))
        register_hook(model, hook, start_iter=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for _ in range(3):  # PowerSGD compresses from its third step on
            _step(model, opt, x, y, True)
        models[hook] = (model, opt)
    times: Dict[str, Dict[str, Dict[str, List[float]]]] = {
        r: {h: {"synced": [], "local": []} for h in args.hooks} for r in args.rates}
    seq = 0
    for round_ in range(args.rounds):
        for rate in args.rates:
            _request_rate(rt, rate, args.sync_dir, seq)
            seq += 1
            for hook in args.hooks:
                synced, local = _cell(*models[hook], x, y, args)
                times[rate][hook]["synced"] += synced
                times[rate][hook]["local"] += local
                rt.print0(f"round {round_} {rate} {hook}: synced "
                         + " ".join(f"{t:.2f}" for t in synced) + " | no-sync "
                         + " ".join(f"{t:.2f}" for t in local))
    if rt.is_main:
        with open(args.json, "w") as f:
            json.dump({"world_size": rt.world_size, "times": times}, f, indent=1)
    rt.shutdown()


# ----------------------------------------------------------------------------- orchestration

def _serve_shaping(c: Any, sync_dir: str, procs_done: Callable[[], bool]) -> None:
    """Apply each rate rank 0 asks for (want-N) to both nodes, both directions; answer ok-N."""
    seq = 0
    while not procs_done():
        want = os.path.join(sync_dir, f"want-{seq}")
        if not os.path.exists(want):
            time.sleep(0.2)
            continue
        with open(want) as f:
            rate = f.read().strip()
        for i in range(2):
            c.shape(i, None if rate == "unshaped" else rate)
        open(os.path.join(sync_dir, f"ok-{seq}"), "w").close()
        seq += 1


def run_job(args: argparse.Namespace) -> Dict[str, Any]:
    """The 2-node job; the links are reshaped whenever rank 0 asks."""
    from netns import Cluster

    out, sync_dir = os.path.join(args.out, "times.json"), os.path.join(args.out, "sync")
    shutil.rmtree(sync_dir, ignore_errors=True)
    os.makedirs(sync_dir)
    tail = [__file__, "--worker", "--json", out, "--sync-dir", sync_dir, "--rounds",
            str(args.rounds), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--rates", *args.rates, "--hooks", *args.hooks]
    with Cluster(2, workdir=os.path.join(args.out, "logs")) as c:
        for i in range(2):
            c.start(i, [sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "--nproc", "1",
                        "--rdzv-endpoint", f"{c.ip(0)}:29400", "--iface", c.iface, *tail],
                    env={"OMP_NUM_THREADS": "1"}, cwd=ROOT)
        done = lambda: all(p.poll() is not None for p in c.procs.values())  # noqa: E731
        _serve_shaping(c, sync_dir, done)
        codes = c.wait(timeout=args.timeout)
        if codes != [0, 0]:
            raise RuntimeError(f"exit codes {codes}\n{c.tails(30)}")
    with open(out) as f:
        return json.load(f)


def summarize(job: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per link and hook: median step, images/s and efficiency vs unshaped uncompressed, raw
    and load-adjusted (each cell's median synced step over its own median no-sync step)."""
    images = job["world_size"] * PER_RANK_BATCH
    base = job["times"]["unshaped"]["none"]
    base_step = statistics.median(base["synced"])
    base_ratio = base_step / statistics.median(base["local"])
    rows = []
    for rate, per_hook in job["times"].items():
        for hook, t in per_hook.items():
            step, local = statistics.median(t["synced"]), statistics.median(t["local"])
            rows.append({"rate": rate, "hook": hook, "step_s": step, "images_s": images / step,
                         "efficiency": base_step / step, "local_s": local,
                         "adjusted": base_ratio / (step / local), "n": len(t["synced"]),
                         "min_s": min(t["synced"]), "max_s": max(t["synced"])})
    return rows


def throughput_table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of :func:`summarize` rows."""
    lines = ["| link | hook | step s: median (min-max) | no-sync step s | images/s | "
             "efficiency | load-adjusted efficiency |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {r['hook']} | {r['step_s']:.2f} ({r['min_s']:.2f}-"
                     f"{r['max_s']:.2f}) | {r['local_s']:.2f} | {r['images_s']:.1f} | "
                     f"{r['efficiency']:.2f} | {r['adjusted']:.2f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- accuracy

def accuracy_worker(hook: str, seed: int, epochs: int) -> float:
    """small_cnn on the embedded digits, 2 ranks, global batch 64: test top-1 after ``epochs``."""
    import ddpkit
    from ddpkit.job.datasets import digits
    from ddpkit.job.models import build_model

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


def best_hook_at(rows: List[Dict[str, Any]], rate: str) -> Optional[str]:
    """The compressing hook with the best load-adjusted efficiency on ``rate`` links."""
    hooks = [r for r in rows if r["rate"] == rate and r["hook"] != "none"]
    return max(hooks, key=lambda r: r["adjusted"])["hook"] if hooks else None


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-out/multinode")
    p.add_argument("--rates", nargs="+", default=RATES, choices=RATES)
    p.add_argument("--hooks", nargs="+", default=HOOKS)
    p.add_argument("--rounds", type=int, default=2, help="passes over all links and hooks")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per cell and round")
    p.add_argument("--steps", type=int, default=2,
                   help="measured (no-sync, synced) step pairs per cell and round")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole job")
    p.add_argument("--accuracy-seeds", type=int, default=3)
    p.add_argument("--accuracy-epochs", type=int, default=12)
    p.add_argument("--accuracy-hooks", nargs="*", help="default: none + the best at 100mbit")
    p.add_argument("--skip-throughput", action="store_true", help="reuse OUT/times.json")
    # worker side (started by ddpkit run inside each node)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if "unshaped" not in args.rates or "none" not in args.hooks:
        p.error("the baseline needs 'unshaped' in --rates and 'none' in --hooks")
    os.makedirs(args.out, exist_ok=True)
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.skip_throughput:
        with open(os.path.join(args.out, "times.json")) as f:
            job = json.load(f)
    else:
        job = run_job(args)
        print(f"throughput: {time.monotonic() - started:.0f} s", flush=True)
    rows = summarize(job)
    with open(os.path.join(args.out, "throughput.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(throughput_table(rows), flush=True)
    hooks = args.accuracy_hooks
    if hooks is None:
        hooks = ["none"] + [h for h in [best_hook_at(rows, "100mbit")] if h]
    if hooks:
        acc = accuracy(hooks, args.accuracy_seeds, args.accuracy_epochs)
        with open(os.path.join(args.out, "accuracy.json"), "w") as f:
            json.dump(acc, f, indent=1)
        print(accuracy_table(acc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
