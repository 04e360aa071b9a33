"""``ddpkit plan``'s predicted step against ``ddpkit train``'s measured one on 2 namespaced nodes
(tests/netns.py) behind links shaped to 1 Gbit/s, 100 Mbit/s and 10 Mbit/s (issue 34, item 11).
Root only.

    python benchmarks/plan/vs_train_nodes.py --rates 1gbit,100mbit,10mbit \
        --hooks none,bf16,powersgd-batched,auto --runs 3 --plans 5 --epochs 8 --bucket 1600
    python benchmarks/plan/vs_train_nodes.py --rates 1gbit --hooks none,bf16,auto --runs 2 \
        --plans 3 --epochs 3 --bucket 1600 \
        --job "--model resnet18 --data synthetic --synthetic-samples 1024"

For each rate: ``ddpkit doctor`` measures the link between the two nodes (its JSON is plan's
``--link``), then plan's runs and train's runs take turns (plan on the host, one rank a node:
``--nodes 2 --nproc 1 --host-ranks 2``, the step timed on both nodes' ranks at once as
they share this host's cores; train as ``ddpkit train --nnodes 2 --nproc 1`` on both nodes). Every
rank runs one thread (OMP_NUM_THREADS=1): the two nodes share this host's two cores, one each,
as two one-core machines would. Every link is shaped strictly, every byte at the rate, as near
as tbf comes to a wire (its bucket holds at least one packet, which passes at veth speed after an
idle moment): at 1 Gbit/s and over 16 KB packets and a bucket of one (``--packet``; one-frame
packets cost more CPU than 2 cores have, and tbf's default bucket, 4 ms of traffic = 500 KB, let
a step's 123 KB of gradients through at veth speed: training paid 0.35-1 ms a step less than
their bytes at the rate); from 100 Mbit/s one-frame packets (tbf's bucket ``--bucket``); below
100 Mbit/s 576-byte frames and a bucket of one (``--slow-mtu``: a 1500-byte frame is 1.2 ms at
10 Mbit/s, and a PowerSGD's 1.4 KB halves passed free; 576-byte frames at 100 Mbit/s cost more
CPU than 2 cores have). Train's step is its median over epochs 2.. (the first holds warm-up and
auto's measuring).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

from netns import Cluster, rate_bits  # noqa: E402
from vs_train import _plan_args  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
BUCKET = None  # --bucket: tbf's bucket in bytes from 100 Mbit/s to 1 Gbit/s
PACKET = 16384  # --packet: the packet cap (and bucket, with a frame) at 1 Gbit/s and over
SLOW_MTU = 576  # --slow-mtu: the frames (and bucket, with 124 B) below 100 Mbit/s
JOB = ""  # --job: train's flags for the job (default: ddpkit train's own)


def on_nodes(rate, port, argv, launch, env=None):
    """Run ``argv`` on 2 namespaced nodes behind ``rate`` (``launch``: ``run`` for a script,
    ``train`` for the job); rank 0's node output."""
    with Cluster(2) as c:
        if rate != "none":
            bits = rate_bits(rate)
            for i in range(2):
                if bits >= 1e9:
                    c.shape(i, rate, strict=True, packet=PACKET, bucket=PACKET + 1514)
                elif bits < 100e6 and SLOW_MTU:
                    c.shape(i, rate, strict=True, packet=SLOW_MTU, bucket=SLOW_MTU + 124,
                            mtu=SLOW_MTU)
                else:
                    c.shape(i, rate, strict=True, bucket=BUCKET)
        for i in range(2):
            c.start(i, [sys.executable, "-m", "ddpkit", launch, "--nnodes", "2", "--nproc", "1",
                        "--node-rank", str(i), "--rdzv-endpoint", f"{c.ip(0)}:{port}",
                        *[a.replace("{node}", str(i)) for a in argv]],
                    env={**ONE_THREAD, **(env or {})}, cwd=ROOT)
        codes = c.wait(timeout=900)
        if codes != [0, 0]:
            raise SystemExit(f"{launch} {argv} behind {rate} failed: {c.tails()}")
        return c.output(0)


def doctor(rate, port, tmp):
    path = os.path.join(tmp, f"doctor-{rate}.json")
    on_nodes(rate, port, ["-m", "ddpkit.doctor", "--max-bytes",
                          "4M" if rate == "10mbit" else "16M", "--json", path], "run")
    return path


def plan(link, tmp, index):
    path = os.path.join(tmp, f"plan-{index}.json")
    # --host-ranks 2: both nodes' ranks run on this host's cores at once, as the job's do
    done = subprocess.run([sys.executable, "-m", "ddpkit", "plan", "--nodes", "2", "--nproc", "1",
                           "--host-ranks", "2", "--link", link, "--json", path, *_plan_args(JOB)],
                          capture_output=True, text=True,
                          env={**os.environ, **ONE_THREAD}, timeout=900)
    if done.returncode:
        raise SystemExit(f"plan failed: {done.stderr[-2000:]}")
    with open(path) as f:
        data = json.load(f)
    return {"steps": {r["hook"]: r["total"] for r in data["rows"] if r["nodes"] == 2},
            "pick": data["recommendation"]["2"]["hook"]}


def train(rate, port, tmp, hook, epochs, index):
    out = os.path.join(tmp, f"run-{rate}-{hook}-{index}")
    on_nodes(rate, port, ["--epochs", str(epochs), "--eval-every", "0", "--no-ckpt-every-epoch",
                          "--no-progress", "--output", out + "-node{node}"] + shlex.split(JOB) +
             ([] if hook == "none" else ["--comm-hook", hook]), "train")
    with open(os.path.join(out + "-node0", "metrics.jsonl")) as f:
        seen = [json.loads(line) for line in f if '"train/step_ms"' in line]
    chosen = None
    if hook == "auto":
        with open(os.path.join(out + "-node0", "results.json")) as f:
            chosen = json.load(f).get("comm_hook", {}).get("hook")
    return statistics.median(e["train/step_ms"] for e in seen[1:]) / 1e3, chosen


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,100mbit,10mbit")
    p.add_argument("--hooks", default="none,bf16,auto")
    p.add_argument("--runs", type=int, default=2, help="train runs per cell")
    p.add_argument("--plans", type=int, default=3, help="plan runs per rate")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--bucket", type=int, default=None,
                   help="tbf's bucket in bytes from 100 Mbit/s to 1 Gbit/s (default: 2 frames "
                        "or 1 ms of traffic); 1600 is one frame, the nearest tbf comes to a wire, "
                        "where a message's first frame is not free after an idle moment")
    p.add_argument("--packet", type=int, default=16384,
                   help="the packet cap in bytes at 1 Gbit/s and over, the bucket one packet and "
                        "a frame (default 16384)")
    p.add_argument("--slow-mtu", type=int, default=576,
                   help="the MTU below 100 Mbit/s, the bucket one frame (default 576; 0: 1500 "
                        "and --bucket)")
    p.add_argument("--job", default="",
                   help="ddpkit train's flags for the job (default: its own default job), e.g. "
                        "\"--model resnet18 --data synthetic --synthetic-samples 1024\"")
    args = p.parse_args()
    global BUCKET, PACKET, SLOW_MTU, JOB
    BUCKET, PACKET, SLOW_MTU, JOB = args.bucket, args.packet, args.slow_mtu, args.job
    hooks, port, table = args.hooks.split(","), 29700, []
    with tempfile.TemporaryDirectory(prefix="ddpkit-vs-nodes-") as tmp:
        for rate in args.rates.split(","):
            port += 1
            link = doctor(rate, port, tmp)
            with open(link) as f:
                fit = json.load(f)["link"]
            print(f"{rate}: doctor alpha {fit['alpha'] * 1e6:.0f} us, beta "
                  f"{fit['beta'] / 1e6:.2f} MB/s, overlap {fit.get('overlap', 1):.2f}", flush=True)
            plans, trains = [], {h: [] for h in hooks}
            for i in range(max(args.runs, args.plans)):  # in turns
                if i < args.plans:
                    plans.append(plan(link, tmp, f"{rate}-{i}"))
                    print(f"  plan {i}: {plans[-1]}", flush=True)
                for hook in hooks if i < args.runs else []:
                    port += 1
                    trains[hook].append(train(rate, port, tmp, hook, args.epochs, i))
                    print(f"  train {hook} {i}: {trains[hook][-1]}", flush=True)
            for hook in hooks:
                # auto: plan's step for the hook each run chose (like against like); plan's
                # own pick is the last column
                predicted = statistics.median(
                    [pl["steps"][hook] for pl in plans] if hook != "auto" else
                    [statistics.median(pl["steps"][t[1]] for pl in plans) for t in trains[hook]])
                measured = statistics.median(t[0] for t in trains[hook])
                chosen = sorted({t[1] for t in trains[hook] if t[1]})
                table.append((rate, hook + (f" (chose {', '.join(chosen)})" if chosen else ""),
                              predicted, measured, [t[0] for t in trains[hook]],
                              [pl["pick"] for pl in plans]))
    print("\n| link | hook | plan ms | train ms (runs) | plan / train | plan's pick (runs) |")
    print("|---|---|---|---|---|---|")
    for rate, hook, predicted, measured, runs, picks in table:
        print(f"| {rate} | {hook} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} "
              f"({', '.join(f'{r * 1e3:.1f}' for r in runs)}) | {predicted / measured - 1:+.0%} "
              f"| {', '.join(picks)} |")


if __name__ == "__main__":
    main()
