"""What ``ddpkit plan`` prints: one row per node count and hook, the recommendation per node
count, and every assumption the prediction rests on; and the same as JSON.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence

from ..costprobe import Workload
from ..stepcost import Link
from .predict import Row, recommend

__all__ = ["table", "advice", "assumptions", "as_json"]


def table(rows: Sequence[Row]) -> str:
    """Aligned text. Example::

        print(table(predict(work, [1, 2], LINKS["1gbit"])))
    """
    lines = [f"{'nodes':>5} {'ranks':>5}  {'hook':<16} {'step ms':>9} {'comm ms':>9} "
             f"{'waits ms':>9} {'samples/s':>10} {'efficiency':>10}"]
    for r in rows:
        lines.append(f"{r.nodes:>5} {r.ranks:>5}  {r.hook:<16} {1e3 * r.step.total:>9.1f} "
                     f"{1e3 * r.step.communication:>9.1f} {1e3 * r.step.exposed:>9.1f} "
                     f"{r.samples_per_s:>10.1f} {r.efficiency:>10.0%}")
    return "\n".join(lines)


def advice(rows: Sequence[Row], rank: Optional[int] = None) -> List[str]:
    """One line per node count: the hook to use and why (with ``--powersgd-rank`` when the rows
    were predicted at a ``rank`` of the user's, not each hook's default). Example::

        advice(rows)   # ['2 nodes: bf16 (+31% samples/s over plain all-reduce)', ...]
    """
    out = []
    for nodes, (hook, gain) in recommend(rows).items():
        if hook == "none":
            out.append(f"{nodes} node(s): no compression (no hook gains more than 5% here)")
        else:
            risk = "; PowerSGD approximates the gradients: check the accuracy" \
                if hook.startswith("powersgd") else ""
            flag = f" --powersgd-rank {rank}" if rank and hook.startswith("powersgd") else ""
            out.append(f"{nodes} node(s): --comm-hook {hook}{flag} (+{gain:.0%} samples/s over "
                       f"plain all-reduce{risk})")
    return out


def assumptions(work: Workload, link: Link, hooks: Dict[str, float], inside: Link) -> List[str]:
    """What the numbers rest on, stated. Example::

        assumptions(work, LINKS["1gbit"], {"bf16": 0.004, "powersgd": 0.02}, LINKS["10gbit"])
    """
    measured = ", ".join(f"{h} {1e3 * s:.1f} ms" for h, s in hooks.items() if h != "none")
    return [f"model: {work.name}, {work.params:,} parameters, {len(work.bucket_shapes)} "
            f"bucket(s) (1 MiB first, then 25 MiB, as DDP makes them)",
            f"compute: {1e3 * work.compute_s:.1f} ms forward+backward for {work.batch} "
            "samples per rank; forward 1/3 of it, gradients ready in proportion to their bytes",
            f"between nodes: {link.name}, alpha {1e6 * link.alpha:.1f} us, beta "
            f"{link.beta / 1e6:.1f} MB/s" + (f", overlap {link.overlap:.2f} (measured)"
                                            if link.overlap != 1.0 else "") +
            f"; inside a node: {inside.name}",
            f"ring all-reduce; each hook's own compute per step: the hook as DDP runs it, timed "
            f"here on the gradients' shapes, half inline, half after its bucket's all-reduce: "
            f"{measured}"]


def as_json(rows: Sequence[Row], work: Workload, link: Link) -> str:
    """The prediction for machines. Example::

        open("plan.json", "w").write(as_json(rows, work, link))
    """
    data: Dict[str, Any] = {
        "workload": {"name": work.name, "params": work.params, "compute_s": work.compute_s,
                     "batch": work.batch, "buckets": len(work.bucket_shapes)},
        "link": dataclasses.asdict(link),
        "rows": [{"nodes": r.nodes, "ranks": r.ranks, "hook": r.hook,
                  "samples_per_s": r.samples_per_s, "efficiency": r.efficiency,
                  **dataclasses.asdict(r.step)} for r in rows],
        "recommendation": {str(k): {"hook": h, "gain": g} for k, (h, g) in
                           recommend(rows).items()}}
    return json.dumps(data, indent=2)
