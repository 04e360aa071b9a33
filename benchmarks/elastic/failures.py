"""`ddpkit train --nnodes 2:3` on three namespaced nodes (tests/netns.py) with a node killed
every --every seconds and a replacement started --down seconds later: the fraction of an
uninterrupted run's speed that is left (issue 25; torchft reports 81% at one failure a minute).
Root only.

    python benchmarks/elastic/failures.py --every 60 --repeats 1 -- --epochs 40 --batch-size 48

Each round runs the same job twice, uninterrupted then with failures (A B, --repeats rounds);
the efficiency is the uninterrupted wall time over the interrupted one (start-up included in
both). For each failure: seconds from the kill to the survivors' "resumed at step" line (the
next step starts right after it) and from the replacement's start to the grown group's resume.
Everything after `--` goes to `ddpkit train` (every node the same command, one shared --output).
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from netns import Cluster  # noqa: E402

PORT = 29400


ENV = {"OMP_NUM_THREADS": "1"}  # 3 ranks on a few cores: steadier steps than 2 threads each


def command(c, out, extra, last_call):
    return [sys.executable, "-m", "ddpkit", "train", "--nnodes", "2:3", "--nproc", "1",
            "--rdzv-endpoint", f"{c.ip(0)}:{PORT}", "--rdzv-last-call", str(last_call),
            "--output", out, "--no-progress", *extra]


def resumes_after(c, since):
    """monotonic times of node 0's "resumed from" lines (the next step follows) after ``since``."""
    return [t for t, n, line in list(c.lines)
            if n == 0 and t > since and line.startswith("resumed from")]


def one_run(extra, every, down, last_call, failures):
    out = tempfile.mkdtemp(prefix="ddpkit-elastic-")
    events = []
    with Cluster(3) as c:
        start = time.monotonic()
        for i in range(3):
            c.start(i, command(c, out, extra, last_call), env=ENV, cwd=ROOT)
        victim = 1
        while failures and all(c.procs[i].poll() is None for i in range(3)):
            next_at = start + every * (len(events) + 1)
            while time.monotonic() < next_at and c.procs[0].poll() is None:
                time.sleep(0.2)
            if c.procs[0].poll() is not None:
                break
            killed = time.monotonic()
            c.kill(victim)
            c.procs[victim].wait()
            time.sleep(down)
            rejoined = time.monotonic()
            c.start(victim, command(c, out, extra, last_call), env=ENV, cwd=ROOT)
            events.append({"victim": victim, "killed": killed, "rejoined": rejoined})
            victim = 3 - victim  # nodes 1 and 2 by turns; node 0 serves the rendezvous
        codes = c.wait(timeout=3600)
        wall = time.monotonic() - start
        if codes != [0, 0, 0]:
            raise SystemExit(f"the run failed ({codes}):\n{c.tails(30)}")
        for e in events:  # back to training after the kill; with the replacement too
            after = resumes_after(c, e["killed"])
            e["to_training"] = after[0] - e["killed"] if after else None
            grown = resumes_after(c, e["rejoined"] + 1.0)  # a restart the replacement caused
            e["to_grown"] = grown[0] - e["rejoined"] if grown and args_down(e) else None
        steps = max(int(m) for m in re.findall(r"at step (\d+)", c.output(0)) or ["0"])
    return wall, events, steps


def args_down(event):
    """Whether the replacement came after the group had already gone on without it."""
    return event.get("to_training") is not None and \
        event["rejoined"] > event["killed"] + event["to_training"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=float, default=60.0, help="seconds between failures")
    p.add_argument("--down", type=float, default=0.0, help="seconds before the replacement starts")
    p.add_argument("--last-call", type=float, default=10.0, help="--rdzv-last-call")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("train", nargs="*", help="ddpkit train flags (after --)")
    args = p.parse_args()
    rows = []
    for _ in range(args.repeats):
        calm, _, _ = one_run(args.train, args.every, args.down, args.last_call, failures=False)
        stormy, events, _ = one_run(args.train, args.every, args.down, args.last_call, failures=True)
        rows.append({"calm_s": calm, "stormy_s": stormy, "efficiency": calm / stormy,
                     "failures": len(events), "events": events})
        print(json.dumps(rows[-1]), flush=True)
    back = [e["to_training"] for r in rows for e in r["events"] if e["to_training"] is not None]
    grow = [e["to_grown"] for r in rows for e in r["events"] if e["to_grown"] is not None]
    eff = statistics.median(r["efficiency"] for r in rows)
    said = (f"failure every {args.every:g} s, replacement after {args.down:g} s, last call "
            f"{args.last_call:g} s: efficiency {eff:.2f} (uninterrupted "
            f"{statistics.median(r['calm_s'] for r in rows):.0f} s, with "
            f"{sum(r['failures'] for r in rows)} failures "
            f"{statistics.median(r['stormy_s'] for r in rows):.0f} s)")
    if back:
        said += (f"; kill -> training again: median {statistics.median(back):.1f} s "
                 f"(min {min(back):.1f}, max {max(back):.1f}, n={len(back)})")
    if grow:
        said += f"; replacement started -> grown group training: median {statistics.median(grow):.1f} s"
    print(said)


if __name__ == "__main__":
    main()
