"""Predicted against measured DDP step time on two namespaced nodes (tests/netns.py) behind links
shaped with tc tbf, for each comm hook: the check behind issue 24's 15% bound. Root only.

    python benchmarks/plan/validate.py --rates none,1gbit,100mbit,10mbit --hooks none,bf16,powersgd

Compute (forward, backward and the optimizer step; DDP over a group of one rank) and each
hook's own compute (on a process group of one rank) are measured by the ranks of a calibration
job on the same namespaced nodes, every rank at once and in step (worker.py --calibrate): every
node runs on this one host, so what a rank gets while the others run is its device (the slowest
rank's median kept). Links below 1 Gbit/s are shaped strictly (one-frame packets, a 1 ms bucket:
every byte at the rate). The link is the named one (line rate x 0.94, 50 us) or what
ddpkit doctor measures between the nodes.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from netns import Cluster, rate_bits  # noqa: E402

from ddpkit.cost.measure import measure_flops, workload_of  # noqa: E402
from ddpkit.plan.predict import predict  # noqa: E402
from ddpkit.cli.plan import parse_link  # noqa: E402
from ddpkit.cost.model import LINKS, Link  # noqa: E402

sys.path.insert(0, HERE)
from worker import mlp  # noqa: E402


def parameters(width, depth):
    """The MLP's parameter count and the model itself (its gradient shapes feed the planner)."""
    model = mlp(width, depth)
    return sum(p.numel() for p in model.parameters()), model


def calibrated(nodes, port, args):
    """Compute and hook compute measured by the ranks themselves (worker.py --calibrate) on
    ``nodes`` unshaped namespaced nodes: every rank at once, as they share this host's cores."""
    out = run_on_nodes(nodes, "none", port, [
        os.path.join(HERE, "worker.py"), "--calibrate", "--hooks", args.hooks, "--width",
        str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)])
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def strict(shaping, rate):
    """Whether ``rate`` is shaped strictly: tbf's 64 KB bucket lets a small message (PowerSGD's
    tens of KB a step) through at veth speed after an idle moment, which matters on slow links;
    one-frame packets at 1 Gbit/s cost more CPU than 2 cores have (the link measured ~40 MB/s)."""
    if shaping == "auto":
        return rate != "none" and rate_bits(rate) < 1e9
    return shaping == "strict"


def run_on_nodes(nodes, rate, port, argv, strict=True, env=None):
    """Run ``ddpkit run ... argv`` on ``nodes`` namespaced nodes behind ``rate``; rank 0's
    output."""
    with Cluster(nodes) as c:
        if rate != "none":
            for i in range(nodes):
                c.shape(i, rate, strict=strict)
        for i in range(nodes):
            c.start(i, [sys.executable, "-m", "ddpkit", "run", "--nnodes", str(nodes),
                        "--nproc", "1", "--node-rank", str(i), "--rdzv-endpoint",
                        f"{c.ip(0)}:{port}", *argv], env=env, cwd=ROOT)
        codes = c.wait(timeout=900)
        if codes != [0] * nodes:
            raise SystemExit(f"{argv} on {nodes} nodes behind {rate} failed: {c.tails()}")
        return c.output(0)


def run_cell(nodes, rate, hook, args, port):
    out = run_on_nodes(nodes, rate, port, [
        os.path.join(HERE, "worker.py"), "--hook", hook, "--steps", str(args.steps),
        "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)],
        strict=strict(args.shaping, rate))
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))["step_s"]


def doctor_link(nodes, rate, port, tmp, strict):
    """The link ddpkit doctor measures between the nodes (its sweep up to 16 MiB; 4 MiB on
    10 Mbit/s, 5 s an all-reduce there: TCP's window still grows over the first MiB), with one
    thread a rank as the workers have, so its overlap probe computes as they do."""
    report = os.path.join(tmp, f"doctor-{nodes}-{rate}.json")
    largest = {"10mbit": "4M"}.get(rate, "16M")
    run_on_nodes(nodes, rate, port, ["-m", "ddpkit.doctor", "--max-bytes", largest,
                                     "--json", report], strict=strict,
                 env={"OMP_NUM_THREADS": "1"})
    # as plan --link reads it: alpha, beta, overlap and the sweep's own times
    return dataclasses.replace(parse_link(report), name=f"doctor ({rate})")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="none,1gbit,100mbit,10mbit")
    p.add_argument("--hooks", default="none,bf16,powersgd")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--unshaped-link", default="10gbit", help="the link assumed when unshaped")
    p.add_argument("--nodes", default="2", help="node counts, e.g. 2,3")
    p.add_argument("--measured-link", action="store_true",
                   help="predict from the link ddpkit doctor measures, not the named one")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every cell, in rounds over all cells (the median kept)")
    p.add_argument("--shaping", choices=("auto", "strict", "bursty"), default="auto",
                   help="strict: one-frame packets and a 1 ms bucket, every byte at the rate; "
                        "bursty: the 64 KB bucket of the earlier tables; auto (default): strict "
                        "below 1 Gbit/s, where 64 KB is over 0.5 ms of traffic")
    args = p.parse_args()
    torch.set_num_threads(1)
    flops = measure_flops()
    alone, port = {}, 29600
    for nodes in [int(n) for n in args.nodes.split(",")]:
        port += 1
        alone[nodes] = m = calibrated(nodes, port, args)
        print(f"for {nodes} nodes, measured by the ranks at once: compute "
              f"{m['compute'] * 1e3:.1f} ms, hooks " +
              ", ".join(f"{h} {m[h] * 1e3:.1f} ms" for h in args.hooks.split(",")), flush=True)
    count, model = parameters(args.width, args.depth)
    print(f"{count:,} parameters, {flops / 1e9:.1f} Gflop/s (1 thread)")
    import tempfile
    tmp = tempfile.mkdtemp(prefix="ddpkit-validate-")
    cells, links, measured = [], {}, {}
    for nodes in [int(n) for n in args.nodes.split(",")]:
        for rate in args.rates.split(","):
            port += 1
            links[nodes, rate] = doctor_link(nodes, rate, port, tmp, strict(args.shaping, rate)) \
                if args.measured_link else LINKS[rate if rate != "none" else args.unshaped_link]
            cells += [(nodes, rate, hook) for hook in args.hooks.split(",")]
    for round_ in range(args.repeats):   # every cell once a round: drift is shared by all
        for nodes, rate, hook in cells:
            port += 1
            seconds = run_cell(nodes, rate, hook, args, port)
            measured.setdefault((nodes, rate, hook), []).append(seconds)
            print(f"round {round_ + 1}: {nodes} nodes {rate} {hook}: {seconds * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)
    print(f"{'nodes':>5} {'link':>8} {'hook':>8} {'predicted ms':>13} {'measured ms':>12} "
          f"{'error':>7} {'runs (ms)':>20}  link used")
    held = 0
    for nodes, rate, hook in cells:
        m, link = alone[nodes], links[nodes, rate]
        work = workload_of(model, m["compute"], args.batch, f"mlp {args.width}x{args.depth}")
        hooks = {h: m[h] for h in args.hooks.split(",")}
        runs = measured[nodes, rate, hook]
        median = statistics.median(runs)
        predicted = predict(work, [nodes], link, hooks=[hook], flops_per_s=flops,
                            hook_seconds=hooks)[0].step.total
        held += abs(predicted / median - 1) <= 0.15
        print(f"{nodes:>5} {rate:>8} {hook:>8} {predicted * 1e3:>13.1f} {median * 1e3:>12.1f} "
              f"{predicted / median - 1:>+7.0%} {' '.join(f'{r * 1e3:.0f}' for r in runs):>20}  "
              f"alpha {link.alpha * 1e6:.0f} us, beta {link.beta / 1e6:.1f} MB/s, "
              f"overlap {link.overlap:.2f}", flush=True)
    print(f"{held} of {len(cells)} cells within 15% (medians of {args.repeats} run(s) each; "
          f"{args.shaping} shaping)")


if __name__ == "__main__":
    main()
