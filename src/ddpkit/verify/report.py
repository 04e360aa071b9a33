"""What ``ddpkit verify`` prints: a short table of the steps, then PASS with the largest relative
difference, or the first step that diverges and why; and the same as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, List

from .compare import MARGIN, Verdict

__all__ = ["table", "summary", "as_json"]


def table(verdict: Verdict, nproc: int) -> str:
    """The steps as aligned text: step, samples equal, loss 1 vs N, relative difference.

    Example::

        print(table(verdict, 2))
    """
    head = f"{'step':>4}  {'samples':>7}  {'loss (1 proc)':>14}  {'loss (' + str(nproc) + ' procs)':>15}" \
           f"  {'rel. diff':>9}  {'tolerance':>9}  verdict"
    lines = [head]
    for row in verdict.steps:
        same = {True: "equal", False: "DIFFER", None: "-"}[row["samples_equal"]]
        lines.append(f"{row['step']:>4}  {same:>7}  {row['loss_1']:>14.8f}  "
                     f"{row['loss_n']:>15.8f}  {row['relative']:>9.2e}  "
                     f"{row['tolerance']:>9.2e}  {row['verdict']}")
    return "\n".join(lines)


def summary(verdict: Verdict, nproc: int, script: str, accum: int = 1) -> str:
    """The evidence behind the verdict (a cause's observations; what a PASS compared and
    did not), one line each, then the verdict in one line.

    Example::

        summary(verdict, 2, "train.py")   # 'PASS: train.py computes the same on 2 ...'
    """
    steps = sum(not row.get("after_eval") for row in verdict.steps) \
        if verdict.amplified is None else verdict.amplified[0] - 1
    said = [f"  evidence: {line}" for line in verdict.evidence] + \
        [f"  compared: {line}" for line in verdict.notes]
    return "\n".join([*said, _verdict_line(verdict, nproc, script, max(accum, verdict.accum),
                                           steps)])


def _verdict_line(verdict: Verdict, nproc: int, script: str, accum: int, steps: int) -> str:
    if verdict.passed:
        one = f"1 accumulating {accum} micro-batches" if accum > 1 else "1"
        return (f"PASS: {script} computes the same on {nproc} processes as on {one} over {steps} "
                f"steps (largest relative difference {verdict.largest:.1e}; tolerance "
                f"{MARGIN:g}x the spread of 1 process with its batches reversed, at least "
                f"{verdict.floor:g}{_dtype(verdict)})")
    where = f" at step {verdict.first_divergent}" if verdict.first_divergent else ""
    return f"FAIL{where} [{verdict.cause}]: {verdict.why}"


def _dtype(verdict: Verdict) -> str:
    if not verdict.autocast:
        return ""
    return (f", at most {verdict.ceiling:g}: bounds of {'/'.join(verdict.autocast)} autocast, "
            "one to eight roundings")


def as_json(verdict: Verdict, nproc: int, script: str, args: List[str], accum: int = 1) -> str:
    """The report for machines: the verdict, the cause and every step's figures.

    Example::

        open("verify.json", "w").write(as_json(verdict, 2, "train.py", []))
    """
    data: Dict[str, Any] = {"script": script, "args": list(args), "nproc": nproc,
                            "accum_steps": max(accum, verdict.accum),
                            "tolerance": {"margin": MARGIN, "floor": verdict.floor,
                                          "ceiling": verdict.ceiling},
                            **dataclasses.asdict(verdict)}
    return json.dumps(_finite(data), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    """NaN and infinities as null: the report stays JSON that any parser reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
