"""What ``ddpkit plan`` prints: one row per node count and hook, the recommendation per node
count, and every assumption the prediction rests on; and the same as JSON.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence

from ..cost.measure import Workload
from ..cost.model import Link
from .measure import Measured
from .predict import Row, recommend

__all__ = ["table", "advice", "assumptions", "as_json"]


def _sweep_note(link: Link) -> str:
    return (f", an all-reduce what its sweep took at its size ({len(link.sweep)} sizes on "
            f"{link.sweep_ranks} ranks)") if link.swept else ""


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


def advice(rows: Sequence[Row], rank: Optional[int] = None, slow: Sequence[Row] = ()
           ) -> List[str]:
    """One line per node count: the hook to use and why (with ``--powersgd-rank`` when the rows
    were predicted at a ``rank`` of the user's, not each hook's default; ``slow``: the rows at
    the slow end of the measured compute, see :func:`~ddpkit.plan.predict.recommend`). Example::

        advice(rows)   # ['2 nodes: bf16 (+31% samples/s over plain all-reduce)', ...]
    """
    out = []
    for nodes, (hook, gain) in recommend(rows, slow).items():
        if hook == "none":
            out.append(f"{nodes} node(s): no compression (no hook gains more than 5% here" +
                       (", over the measured compute's spread)" if slow else ")"))
        else:
            risk = "; PowerSGD approximates the gradients: check the accuracy" \
                if hook.startswith("powersgd") else ""
            flag = f" --powersgd-rank {rank}" if rank and hook.startswith("powersgd") else ""
            out.append(f"{nodes} node(s): --comm-hook {hook}{flag} (+{gain:.0%} samples/s over "
                       f"plain all-reduce{risk})")
    return out


def assumptions(work: Workload, link: Link, measured: Measured, inside: Link) -> List[str]:
    """What the numbers rest on, stated: among them the input, the threads and each timing's
    spread. Example::

        assumptions(work, LINKS["1gbit"], measured, LINKS["10gbit"])
    """
    buffers = (f"; {work.buffer_bytes / 1024:.1f} KiB of buffers DDP broadcasts before every "
               "forward (between a node's ranks in its timed step, across nodes log2(ranks) "
               "hops of the link)") if work.buffer_bytes else ""
    return [f"model: {work.name}, {work.params:,} parameters, {len(work.bucket_shapes)} "
            f"bucket(s) (1 MiB first, then 25 MiB, as DDP makes them){buffers}",
            _compute(work, measured)] + _node(measured) + [
            f"between nodes: {link.name}, alpha {1e6 * link.alpha:.1f} us, beta "
            f"{link.beta / 1e6:.1f} MB/s" + (f", overlap {link.overlap:.2f} (measured)"
                                            if link.overlap != 1.0 else "") +
            _sweep_note(link) +
            f"; inside a node: {inside.name}" + (f", alpha {1e6 * inside.alpha:.1f} us, beta "
                                                 f"{inside.beta / 1e6:.1f} MB/s" + _sweep_note(inside)
                                                 if inside.name != link.name else ""),
            "ring all-reduce; each hook's own compute per step: the hook as DDP runs it, timed "
            "here on the gradients' shapes as the compute was, half inline, half after its "
            "bucket's all-reduce: " +
            (", ".join(f"{h} {t}" for h, t in measured.hooks.items() if h != "none") or "none")]


def _node(measured: Measured) -> List[str]:
    """The one-node line, when that node's whole step was measured."""
    if measured.node is None:
        return []
    return [f"one node: its whole step measured, {measured.node} with the gradients all-reduced "
            f"between its {measured.ranks_per_node} ranks (the 1-node rows: that, each hook "
            "its modelled difference to plain all-reduce on top)"]


def _compute(work: Workload, measured: Measured) -> str:
    """The compute line: what was timed, on which input, with how many threads, and the spread."""
    if measured.compute is None:
        return (f"compute: {1e3 * work.compute_s:.1f} ms a step for {work.batch} samples per "
                "rank (--compute-ms); forward 1/3 of it, gradients ready in proportion to their "
                "bytes")
    return (f"compute: {measured.compute} a training step (batch drawn, DDP's buffer "
            f"broadcast between the timed ranks, forward, loss, backward, SGD step; gradients "
            f"averaged over a group of one) of {work.batch} samples, input "
            f"{measured.input.describe()}, on {_timed_on(measured)} at once on {measured.device} with {measured.threads} thread(s) each (as ddpkit train "
            "sets them), the slowest's; forward 1/3 of it, gradients ready in proportion to "
            "their bytes")


def _timed_on(measured: Measured) -> str:
    if measured.ranks_timed == measured.ranks_per_node:
        return f"{measured.ranks_per_node} rank(s) of this node"
    return (f"{measured.ranks_timed} ranks of this host (--host-ranks: nodes sharing its "
            "cores)")


def as_json(rows: Sequence[Row], work: Workload, link: Link,
            measured: Optional[Measured] = None, slow: Sequence[Row] = ()) -> str:
    """The prediction for machines. Example::

        open("plan.json", "w").write(as_json(rows, work, link, measured))
    """
    data: Dict[str, Any] = {
        "workload": {"name": work.name, "params": work.params, "compute_s": work.compute_s,
                     "batch": work.batch, "buckets": len(work.bucket_shapes)},
        "measured": None if measured is None else _measured(measured),
        "link": dataclasses.asdict(link),
        "rows": [{"nodes": r.nodes, "ranks": r.ranks, "hook": r.hook,
                  "samples_per_s": r.samples_per_s, "efficiency": r.efficiency,
                  **dataclasses.asdict(r.step)} for r in rows],
        "recommendation": {str(k): {"hook": h, "gain": g} for k, (h, g) in
                           recommend(rows, slow).items()}}
    return json.dumps(data, indent=2)


def _measured(measured: Measured) -> Dict[str, Any]:
    return {"input": None if measured.input is None else {
                "shape": list(measured.input.shape), "source": measured.input.source},
            "threads": measured.threads, "device": measured.device,
            "ranks_per_node": measured.ranks_per_node, "ranks_timed": measured.ranks_timed,
            "node": None if measured.node is None else dataclasses.asdict(measured.node),
            "compute": None if measured.compute is None else dataclasses.asdict(measured.compute),
            "hooks": {h: dataclasses.asdict(t) for h, t in measured.hooks.items()}}
