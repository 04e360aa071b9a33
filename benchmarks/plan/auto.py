"""`ddpkit train --comm-hook auto` on two namespaced nodes (tests/netns.py) behind links shaped
with tc tbf, against uncompressed training unshaped: issue 24's throughput (>= 0.9 of the
unshaped at 100 Mbit/s, >= 0.7 at 10 Mbit/s) and accuracy (within 0.5 points) figures. Root only.

    python benchmarks/plan/auto.py --rates none,100mbit,10mbit --epochs 12 -- --batch-size 256

Each cell is whole `ddpkit train` runs (--repeats rounds over all cells, the median kept; one
rank per node, the built-in job on its embedded data; the same seed, or with --seeds one seed a
round); throughput is the median of its epochs' training samples/s from the second on (the
start-up probe and the trial are in the first), accuracy its final top-1, and "vs none" its
mean difference from the first cell's (uncompressed, unshaped) run of the same round. Everything
after `--` goes to `ddpkit train`.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from netns import Cluster  # noqa: E402


def train_on_nodes(rate, hook, port, out, extra, threads, strict=True):
    with Cluster(2) as c:
        if rate != "none":
            for i in range(2):
                c.shape(i, rate, strict=strict)
        for i in range(2):
            c.start(i, [sys.executable, "-m", "ddpkit", "train", "--nnodes", "2", "--nproc", "1",
                        "--node-rank", str(i), "--rdzv-endpoint", f"{c.ip(0)}:{port}",
                        "--output", os.path.join(out, f"node{i}"), "--no-progress",
                        *(["--comm-hook", hook] if hook != "none" else []), *extra],
                    env={"OMP_NUM_THREADS": str(threads)}, cwd=ROOT)
        codes = c.wait(timeout=1800)
        if codes != [0, 0]:
            raise SystemExit(f"{hook} behind {rate} failed: {c.tails()}")
        said = next((line for line in c.output(0).splitlines()
                     if line.startswith("comm hook auto:")), "")
    with open(os.path.join(out, "node0", "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(out, "node0", "metrics.jsonl")) as f:
        epochs = [json.loads(line) for line in f]
    speeds = [e["train/samples_per_s"] for e in epochs if e.get("epoch", 0) >= 2
              and "train/samples_per_s" in e]
    return statistics.median(speeds), results["final"]["eval/top1"], said


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="none,100mbit,10mbit")
    p.add_argument("--hooks", default="none,auto")
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds over every cell, one after another (A B A B); the median kept")
    p.add_argument("--seeds", default=None,
                   help="one --seed per round, e.g. 0,1,2 (sets the rounds): accuracy compared "
                        "seed by seed with the first cell (uncompressed, unshaped)")
    p.add_argument("--shaping", choices=("strict", "bursty"), default="strict",
                   help="strict: one-frame packets and a 1 ms bucket, every byte at the rate "
                        "(default); bursty: the 64 KB bucket of the earlier tables, which lets "
                        "a small message through at veth speed after an idle moment")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    tmp = tempfile.mkdtemp(prefix="ddpkit-auto-")
    print(f"ddpkit train {' '.join(extra)} on 2 nodes x 1 rank ({args.threads} thread each), "
          f"{args.shaping} shaping")
    print(f"{'link':>8} {'hook':>5} {'samples/s':>10} {'vs unshaped':>12} {'top-1 (each)':>14} "
          f"{'vs none':>8}  chosen (each)")
    cells = [(rate, hook) for rate in args.rates.split(",") for hook in args.hooks.split(",")]
    seen, port = {cell: [] for cell in cells}, 29700
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [None] * args.repeats
    for round_, seed in enumerate(seeds):
        for rate, hook in cells:
            port += 1
            seen[(rate, hook)].append(train_on_nodes(
                rate, hook, port, os.path.join(tmp, f"{rate}-{hook}-{round_}"),
                extra + ([] if seed is None else ["--seed", str(seed)]), args.threads,
                strict=args.shaping == "strict"))
    base = statistics.median(s for s, _, _ in seen[cells[0]])  # uncompressed, unshaped
    for rate, hook in cells:
        speed = statistics.median(s for s, _, _ in seen[(rate, hook)])
        top1 = ", ".join(f"{t:.2f}" for _, t, _ in seen[(rate, hook)])
        # top-1 against the first cell's run of the same round (the same seed), averaged
        delta = statistics.mean(t - b for (_, t, _), (_, b, _) in
                                zip(seen[(rate, hook)], seen[cells[0]]))
        chosen = " | ".join(said[len("comm hook auto: "):].split(";")[0].split(" (tried")[0]
                            for _, _, said in seen[(rate, hook)] if said) or "-"
        print(f"{rate:>8} {hook:>5} {speed:>10.0f} {speed / base:>12.2f} {top1:>14} "
              f"{delta:>+8.2f}  {chosen}", flush=True)


if __name__ == "__main__":
    main()
