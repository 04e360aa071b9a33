"""Same workload, four loops: hand-written DDP, ddpkit, Accelerate, Lightning Fabric.

    python benchmarks/peers/run_peers.py --rounds 3 --output peers-out

Every measurement is a fresh ``torchrun`` of peer_worker.py (same launcher for all peers); the
peers alternate within each round (order rotated every round) so machine drift hits all of them.
With ``--interleave`` each round is one job in which every peer is built and their steps
alternate A B A B (order rotated every step): the pairs are then seconds apart, not minutes.
Reports global images/s per peer and its ratio to the hand-written loop, paired by round, also
per CPU second the ranks got (on a shared machine, other programs' load is then factored out).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from ddpkit.bench.environment import environment
from ddpkit.bench.report import cpu_share, median, percentile, repeat_figures

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ("handwritten", "ddpkit", "accelerate", "fabric")
#: Not in the default set: ddpkit with DDP's default gradient_as_bucket_view=False (diagnostic),
#: a second identical hand-written loop (A/A control: the noise floor of the ratios), and ddpkit
#: fed by a DataLoader from host memory like the others (on a GPU its default keeps the data
#: on the device).
EXTRA_PEERS = ("ddpkit-nobv", "handwritten-copy", "ddpkit-dataloader")
ALL_PEERS = PEERS + EXTRA_PEERS
NEEDS = {"accelerate": ("accelerate", "pip install accelerate"),
         "fabric": ("lightning", "pip install lightning")}


def missing(peer: str) -> Optional[str]:
    """Why ``peer`` cannot run here (its package is not importable), or None."""
    if peer not in NEEDS:
        return None
    module, hint = NEEDS[peer]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed ({hint}; check it keeps your torch)"
    return None


def run_once(peer: str, args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """One torchrun of ``peer`` (or of several, comma-separated, interleaved step by step);
    {peer: its figures, or {"error": one line}}."""
    names = peer.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), os.path.join(HERE, "peer_worker.py"),
               "--peer", peer, "--batch", str(args.batch), "--threads", str(args.threads),
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--model", args.model, "--device", args.device, "--result", result]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))  # torchrun would force 1
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {n: {"error": f"timed out after {args.timeout} s"} for n in names}
        if proc.returncode != 0 or not os.path.exists(result):
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            return {n: {"error": (lines or ["exit code %d" % proc.returncode])[-1][:300]}
                    for n in names}
        with open(result) as f:
            by_peer = json.load(f)["peers"]
    return {n: _figures(by_peer[n], args) for n in names}


def _figures(ranks: List[Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    out = repeat_figures([r["step_s"] for r in ranks], args.nproc * args.batch)
    threads = [r["threads"] for r in ranks]
    out.update(step_s=[r["step_s"] for r in ranks], threads=threads,
               peak_mb=[r["peak_mb"] for r in ranks], cpu_s=[r["cpu_s"] for r in ranks],
               cpu_share=cpu_share([r["step_s"] for r in ranks], [r["cpu_s"] for r in ranks],
                                   threads), load_average=round(os.getloadavg()[0], 2))
    return out


def rounds(args: argparse.Namespace, peers: List[str]) -> Dict[str, List[Dict[str, Any]]]:
    """ABCD, BCDA, CDAB, ...: every peer in every round, in rotating order (one job per peer, or
    with ``args.interleave`` one job per round whose steps alternate between the peers)."""
    results: Dict[str, List[Dict[str, Any]]] = {p: [] for p in peers}
    for rnd in range(args.rounds):
        order = peers[rnd % len(peers):] + peers[:rnd % len(peers)]
        jobs = [",".join(order)] if args.interleave else order
        for job in jobs:
            for peer, res in run_once(job, args).items():
                res["round"] = rnd
                results[peer].append(res)
                shown = res.get("error") or (f"{res['images_s']:.1f} images/s, CPU share "
                                             f"{res['cpu_share']:.2f}, load "
                                             f"{res['load_average']}")
                print(f"[round {rnd + 1}/{args.rounds}] {peer}: {shown}", flush=True)
    return results


def step_ratios(base: List[Dict[str, Any]], other: List[Dict[str, Any]]) -> List[float]:
    """Hand-written step time / peer step time, step by step within each round (slowest rank
    per step). Only meaningful for ``--interleave`` runs, where step i of every peer ran in the
    same few seconds; > 1 means the peer was faster.

    Example::

        step_ratios([{"round": 0, "step_s": [[2.0, 4.0]]}], [{"round": 0, "step_s": [[2.0, 5.0]]}])
        # [1.0, 0.8]
    """
    by_round = {r["round"]: r for r in base if "step_s" in r}
    out: List[float] = []
    for rec in other:
        ref = by_round.get(rec["round"])
        if ref is None or "step_s" not in rec:
            continue
        mine, theirs = ([max(t) for t in zip(*r["step_s"])] for r in (rec, ref))
        out += [b / a for a, b in zip(mine, theirs)]
    return out


def summarize(results: Dict[str, List[Dict[str, Any]]], skipped: Dict[str, str],
              interleaved: bool = False) -> List[Dict]:
    """Median images/s per peer, min-max, and the per-round ratio to the hand-written loop
    (and, for interleaved runs, the step-by-step ratio: median and interquartile range)."""
    base = {r["round"]: r["images_s"] for r in results.get("handwritten", []) if "images_s" in r}
    rows = []
    for peer in [p for p in ALL_PEERS if p in results or p in skipped]:
        if peer in skipped:
            rows.append({"peer": peer, "status": f"skipped: {skipped[peer]}"})
            continue
        ok = [r for r in results[peer] if "images_s" in r]
        errors = [r["error"] for r in results[peer] if "error" in r]
        row: Dict[str, Any] = {"peer": peer, "status": f"failed: {errors[0]}" if errors else "ok"}
        if ok:
            ips = [r["images_s"] for r in ok]
            ratios = [r["images_s"] / base[r["round"]] for r in ok if r["round"] in base]
            # per CPU second: what each loop does with the cores it got (others' load removed)
            norm_base = {r["round"]: r["images_s"] / r["cpu_share"]
                         for r in results.get("handwritten", []) if r.get("cpu_share")}
            per_cpu = [r["images_s"] / r["cpu_share"] / norm_base[r["round"]] for r in ok
                       if r["round"] in norm_base and r.get("cpu_share")]
            row.update(images_s=median(ips), images_s_range=[min(ips), max(ips)],
                       ratio=median(ratios) if ratios else None,
                       ratio_range=[min(ratios), max(ratios)] if ratios else None,
                       rounds=len(ok), cpu_share=median([r.get("cpu_share", 0.0) for r in ok]),
                       ratio_per_cpu=median(per_cpu) if per_cpu else None,
                       ratio_per_cpu_range=[min(per_cpu), max(per_cpu)] if per_cpu else None)
            steps = step_ratios(results.get("handwritten", []), ok) if interleaved else []
            if steps:
                row.update(step_ratio=median(steps), step_ratio_iqr=[
                    percentile(steps, 25), percentile(steps, 75)], step_pairs=len(steps))
        rows.append(row)
    return rows


def _ratio(value: Optional[float], span: Optional[List[float]]) -> str:
    if value is None or span is None:
        return "-"
    return f"{value:.3f} ({span[0]:.3f}-{span[1]:.3f})"


def table(rows: List[Dict[str, Any]]) -> str:
    """Markdown: images/s, ratio to hand-written raw and per CPU second, CPU share, status;
    for interleaved runs also the step-paired ratio (median and IQR)."""
    by_step = any("step_ratio" in r for r in rows)
    lines = ["| peer | images/s (min-max) | x hand-written, paired by round (min-max) | "
             + ("x hand-written, paired by step: median (IQR) | " if by_step else "")
             + "CPU share | x hand-written per CPU second (min-max) | status |",
             "|---|---|---|---|---|---|" + ("---|" if by_step else "")]
    for r in rows:
        if "images_s" not in r:
            lines.append(f"| {r['peer']} | - | - | " + ("- | " if by_step else "")
                         + f"- | - | {r['status']} |")
            continue
        lo, hi = r["images_s_range"]
        step = (f"{_ratio(r.get('step_ratio'), r.get('step_ratio_iqr'))} "
                f"[{r.get('step_pairs', 0)} pairs] | " if by_step else "")
        lines.append(f"| {r['peer']} | {r['images_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
                     f"{_ratio(r['ratio'], r['ratio_range'])} | {step}{r['cpu_share']:.2f} | "
                     f"{_ratio(r['ratio_per_cpu'], r['ratio_per_cpu_range'])} | "
                     f"{r['status']} ({r['rounds']} rounds) |")
    return "\n".join(lines) + "\n"


def reprint(path: str) -> str:
    """The table of a saved peers.json, recomputed from its raw figures."""
    with open(path) as f:
        saved = json.load(f)
    skipped = {r["peer"]: r["status"][len("skipped: "):] for r in saved["summary"]
               if r["status"].startswith("skipped")}
    interleaved = bool(saved.get("environment", {}).get("interleave"))
    return table([r for r in summarize(saved["raw"], skipped, interleaved)
                  if r["peer"] in saved["raw"] or r["peer"] in skipped])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", default=",".join(PEERS), help="subset, comma-separated")
    for flag, default in (("--rounds", 3), ("--nproc", 2), ("--batch", 64), ("--threads", 1),
                          ("--steps", 4), ("--warmup", 1), ("--timeout", 900)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: every peer on the rank's GPU (NCCL), one rank per GPU")
    p.add_argument("--interleave", action="store_true",
                   help="one job per round, the peers' steps alternating (A B A B)")
    p.add_argument("--output", default="peers-out")
    p.add_argument("--report", metavar="PEERS_JSON", help="re-print the table of a saved run")
    args = p.parse_args(argv)
    if args.report:
        print(reprint(args.report), end="")
        return 0
    wanted = [x.strip() for x in args.peers.split(",") if x.strip()]
    unknown = sorted(set(wanted) - set(ALL_PEERS))
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; valid: "
                f"{', '.join(ALL_PEERS)}")
    skipped = {peer: why for peer in wanted if (why := missing(peer))}
    started = time.perf_counter()
    results = rounds(args, [x for x in wanted if x not in skipped])
    rows = summarize(results, skipped, args.interleave)
    rows = [r for r in rows if r["peer"] in wanted]
    text = table(rows)
    print("\n" + text, end="")
    os.makedirs(args.output, exist_ok=True)
    env = environment({"model": args.model, "batch_per_rank": args.batch, "nproc": args.nproc,
                       "threads_per_process": args.threads, "steps": args.steps,
                       "warmup": args.warmup, "rounds": args.rounds, "loader_workers": 0,
                       "interleave": args.interleave, "device": args.device,
                       "seconds": round(time.perf_counter() - started, 1)})
    with open(os.path.join(args.output, "peers.md"), "w") as f:
        f.write(f"# Peers: {args.model} on {args.device}, per-rank batch {args.batch}, "
                f"{args.nproc} processes x {args.threads} thread(s)\n\n{text}\nCommand: `{env['command']}`\n")
    with open(os.path.join(args.output, "peers.json"), "w") as f:
        json.dump({"environment": env, "summary": rows, "raw": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
