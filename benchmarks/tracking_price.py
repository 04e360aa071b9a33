"""The price of each tracker integration, side by side: what ``setup(log_to=...)`` adds to a
script's start (importing the tracker, opening its run), what the first ``rt.log`` costs, and
what ``rt.log`` adds to each training step, against the same loop that logs nothing.

Each (tracker, round) is a fresh process; the trackers alternate within a round (A B C A B C),
so the host's drift falls on all of them alike. One process, no launcher: the cost is rank 0's.

    python benchmarks/tracking_price.py --rounds 3 --steps 400
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TRACKERS = ("none", "jsonl", "tensorboard", "mlflow", "wandb")


def child(tracker, steps, log_dir, every):
    """One measurement in this process: printed as one JSON line."""
    began = time.perf_counter()
    import torch
    from torch import nn

    import ddpkit
    imported = time.perf_counter()
    log_to = {"none": None, "jsonl": ""}.get(tracker, tracker)
    rt = ddpkit.setup(seed=0, **({} if tracker == "none" else
                                 {"log_to": log_to, "log_dir": log_dir, "project": "price"}))
    set_up = time.perf_counter()
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    ckpt = (rt.checkpointer(os.path.join(log_dir, "ckpt"), model=model, optimizer=opt,
                            every_steps=every, keep=1) if every else None)
    first = None
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if tracker != "none":
            rt.log({"train/loss": loss.item(), "lr": 0.01})
        if ckpt is not None:
            ckpt.step()  # append-only trackers get the records a checkpoint covers, in one batch
        times.append(time.perf_counter() - t0)
        if step == 0:
            first = times[0]
    closing = time.perf_counter()
    if ckpt is not None:
        ckpt.close()
    rt.shutdown()
    closed = time.perf_counter()
    steady = times[steps // 4:]  # after the first quarter: caches, lazily opened files
    print(json.dumps({"tracker": tracker, "import_s": imported - began,
                      "setup_s": set_up - imported, "first_step_s": first,
                      "step_us": 1e6 * statistics.median(steady),
                      "mean_us": 1e6 * statistics.mean(steady),
                      "close_s": closed - closing}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--trackers", default=",".join(TRACKERS))
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="with rt.checkpointer saving every N steps (0: none; every record "
                        "then goes out at once)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.steps, args.log_dir, args.checkpoint_every)
    trackers = args.trackers.split(",")
    rows = {t: [] for t in trackers}
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": ""}
    env.pop("MLFLOW_TRACKING_URI")
    for r in range(args.rounds):
        for tracker in trackers:
            with tempfile.TemporaryDirectory() as tmp:
                out = subprocess.run([sys.executable, __file__, "--child", tracker,
                                      "--steps", str(args.steps), "--log-dir", tmp,
                                      "--checkpoint-every", str(args.checkpoint_every)],
                                     capture_output=True, text=True, env=env, cwd=tmp)
            if out.returncode != 0:
                sys.exit(f"{tracker}: {out.stderr[-2000:]}")
            rows[tracker].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {tracker}: {rows[tracker][-1]}", file=sys.stderr)
    base = statistics.median(x["step_us"] for x in rows.get("none", [])) if "none" in rows \
        else None
    base_mean = statistics.median(x["mean_us"] for x in rows["none"]) if "none" in rows else None
    print("| tracker | setup(log_to=...) s | first step s (import, open the run) | step µs "
          "(median) | added µs (median) | added µs (mean: saves included) | close s |")
    print("|---|---|---|---|---|---|---|")
    for tracker, runs in rows.items():
        med = {k: statistics.median(x[k] for x in runs)
               for k in ("setup_s", "first_step_s", "step_us", "mean_us", "close_s")}
        none = base is None or tracker == "none"
        added = "-" if none else f"{med['step_us'] - base:+.0f}"
        added_mean = "-" if none else f"{med['mean_us'] - base_mean:+.0f}"
        print(f"| {tracker} | {med['setup_s']:.2f} | {med['first_step_s']:.3f} | "
              f"{med['step_us']:.0f} | {added} | {added_mean} | {med['close_s']:.2f} |")


if __name__ == "__main__":
    main()
