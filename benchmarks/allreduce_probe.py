"""Time the gloo all-reduce of a ResNet-18 gradient between N local processes, nothing else.

    python benchmarks/allreduce_probe.py --nproc 2 --threads 1 --repeats 10

Explains the part of DDP's step time that is communication: one flat all-reduce of all
gradient bytes, and the same bytes in DDP-sized 25 MB buckets (what DDP sends per step).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.bench.report import median, percentile
from ddpkit.job.models import build_model


def _timed(fn: Any, repeats: int) -> List[float]:
    fn()  # first call sets up gloo's buffers and pairs
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def probe(model_name: str, threads: int, repeats: int, bucket_mb: float) -> Dict[str, Any]:
    """Runs on every rank; rank 0's dict has the figures in milliseconds."""
    rt = ddpkit.setup()
    torch.set_num_threads(threads)
    numel = sum(p.numel() for p in build_model(model_name, 100, 3).parameters())
    flat = torch.randn(numel)
    per_bucket = int(bucket_mb * 2**20 / 4)
    buckets = list(flat.split(per_bucket))
    results = {"flat": _timed(lambda: dist.all_reduce(flat), repeats),
               "buckets": _timed(lambda: [dist.all_reduce(b) for b in buckets], repeats)}
    out = {"world_size": rt.world_size, "numel": numel, "mbytes": numel * 4 / 2**20,
           "buckets": len(buckets), "threads": threads}
    for key, times in results.items():
        out[f"{key}_ms_median"] = 1000 * median(times)
        out[f"{key}_ms_p95"] = 1000 * percentile(times, 95)
        out[f"{key}_ms_raw"] = [1000 * t for t in times]
    # ring all-reduce moves 2(N-1)/N of the bytes through each rank
    out["bus_gbit_s"] = (2 * (rt.world_size - 1) / rt.world_size * numel * 4 * 8
                         / (out["flat_ms_median"] / 1000) / 1e9)
    return out


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    args = p.parse_args(argv)
    out = ddpkit.launch(probe, args.nproc, args.model, args.threads, args.repeats,
                        args.bucket_mb, timeout=600)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
