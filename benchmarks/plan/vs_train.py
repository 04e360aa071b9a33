"""``ddpkit plan``'s predicted step against ``ddpkit train``'s measured one on this host (issue 34):
a job (the default: small_cnn on the 8x8 digits, 2 CPU ranks) per comm hook, every run
repeated, plan's and train's runs taking turns so that a busy moment of the host falls on both;
and whether plan's recommendation stays the same over its runs.

    python benchmarks/plan/vs_train.py --runs 3 --plans 5 --hooks none,bf16,auto
    python benchmarks/plan/vs_train.py --runs 2 --plans 2 --hooks none,bf16 \\
        --job "--model resnet18 --data synthetic --synthetic-samples 256" --epochs 3

The link inside the host is what ``ddpkit doctor`` measures once at the start (plan --inside).
Train's step is its median over epochs 2.. (the first holds the warm-up and auto's measuring);
auto is compared with the row of the hook plan recommends. Prints a Markdown table.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

DDPKIT = [sys.executable, "-m", "ddpkit"]


def _run(args, timeout=900):
    done = subprocess.run(DDPKIT + args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"ddpkit {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def _plan_args(job):
    """The plan flags that name the same job as train's: model, data (and its shape)."""
    words, out = shlex.split(job), []
    for flag, value in zip(words, words[1:] + [""]):
        if flag in ("--model", "--data", "--data-dir"):
            out += [flag, value]
    return out


def plan_once(tmp, job, inside, index):
    path = os.path.join(tmp, f"plan{index}.json")
    _run(["plan", "--nodes", "1", "--inside", inside, "--json", path] + _plan_args(job))
    with open(path) as f:
        data = json.load(f)
    steps = {r["hook"]: r["total"] for r in data["rows"] if r["nodes"] == 1}
    return {"steps": steps, "pick": data["recommendation"]["1"]["hook"],
            "compute": data["measured"]["compute"], "threads": data["measured"]["threads"],
            "input": data["measured"]["input"]}


def train_once(tmp, job, hook, epochs, index):
    out = os.path.join(tmp, f"run-{hook}-{index}")
    _run(["train", "--epochs", str(epochs), "--eval-every", "0", "--no-ckpt-every-epoch",
          "--no-progress", "--output", out] + shlex.split(job) +
         ([] if hook == "none" else ["--comm-hook", hook]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        epochs_seen = [json.loads(line) for line in f if '"train/step_ms"' in line]
    chosen = None
    if hook == "auto":
        with open(os.path.join(out, "results.json")) as f:
            chosen = json.load(f).get("comm_hook", {}).get("hook")
    return {"step": statistics.median(e["train/step_ms"] for e in epochs_seen[1:]) / 1e3,
            "chosen": chosen}


def _ms(values):
    values = sorted(values)
    return f"{statistics.median(values) * 1e3:.2f} ({values[0] * 1e3:.2f}-{values[-1] * 1e3:.2f})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="train runs per hook")
    p.add_argument("--plans", type=int, default=5, help="plan runs")
    p.add_argument("--hooks", default="none,bf16,auto")
    p.add_argument("--job", default="", help="train flags naming the job (default: the default)")
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    hooks = args.hooks.split(",")
    with tempfile.TemporaryDirectory(prefix="ddpkit-vs-") as tmp:
        inside = os.path.join(tmp, "doctor.json")
        _run(["doctor", "--nproc", "2", "--max-bytes", "4M", "--json", inside])
        with open(inside) as f:
            link = json.load(f)["link"]
        print(f"load before: {os.getloadavg()[0]:.2f}; inside link (doctor): alpha "
              f"{link['alpha'] * 1e6:.0f} us, beta {link['beta'] / 1e6:.0f} MB/s, overlap "
              f"{link['overlap']:.2f}", flush=True)
        plans, trains = [], {h: [] for h in hooks}
        for i in range(max(args.runs, args.plans)):   # in turns
            if i < args.plans:
                plans.append(plan_once(tmp, args.job, inside, i))
                print(f"plan {i}: {json.dumps(plans[-1])}", flush=True)
            for hook in hooks if i < args.runs else []:
                trains[hook].append(train_once(tmp, args.job, hook, args.epochs, i))
                print(f"train {hook} {i}: {json.dumps(trains[hook][-1])}", flush=True)
        print(f"load after: {os.getloadavg()[0]:.2f}")
    picks = [pl["pick"] for pl in plans]
    print(f"\nrecommendation over {len(plans)} plan runs: {picks}")
    print("compute (plan, median of its repeats) per run, ms: " +
          ", ".join(f"{pl['compute']['median'] * 1e3:.2f}" for pl in plans))
    print("\n| hook | plan predicted ms, median (min-max) | train measured ms, median (min-max) "
          "| plan / train |\n|---|---|---|---|")
    for hook in hooks:
        # auto: plan's step for the hook each run chose (like against like; whether plan's own
        # pick agrees is the recommendation line above)
        predicted = [pl["steps"][hook] for pl in plans] if hook != "auto" else \
            [statistics.median(pl["steps"][t["chosen"]] for pl in plans) for t in trains[hook]]
        measured = [t["step"] for t in trains[hook]]
        chosen = f" (chose {', '.join(sorted({t['chosen'] for t in trains[hook]}))})" \
            if hook == "auto" else ""
        print(f"| {hook}{chosen} | {_ms(predicted)} | {_ms(measured)} | "
              f"{statistics.median(predicted) / statistics.median(measured) - 1:+.0%} |")


if __name__ == "__main__":
    main()
