"""Is the N-process run the 1-process run? Step by step, within tolerances measured on the
1-process run itself, and when it is not, the first step that differs and why.

The tolerance at step k is 10x the largest relative difference, up to step k, between the
1-process run and the same run with every batch in reverse order (the same samples and math,
another order of the floating-point sums), never less than 8 float32 roundings (1e-6) and never
more than 1e-3. Under bf16/fp16 autocast the bounds come from the dtype: at least one rounding
of it (bf16 7.8e-3, fp16 9.8e-4), at most eight.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .records import RunRecord, Step, relative

__all__ = ["Verdict", "compare", "bounds", "FLOOR", "MARGIN", "CEILING"]

#: The least tolerance: a few float32 roundings (float32's epsilon is 1.2e-7).
FLOOR = 1e-6
#: How much wider than the measured spread the tolerance is.
MARGIN = 10.0
#: The widest tolerance: a script whose 1-process run changes more than this with the order of
#: samples in a batch does not compute one function of the batch; no band can hide that.
CEILING = 1e-3


#: One rounding (machine epsilon) of the dtypes autocast computes in.
EPSILON = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def bounds(autocast: List[str]) -> Tuple[float, float]:
    """The least and the widest tolerance for a run that computed under ``autocast`` dtypes.

    Example::

        bounds([])             # (1e-06, 0.001): float32
        bounds(["bfloat16"])   # (0.0078125, 0.0625)
    """
    eps = max((EPSILON.get(d, 0.0) for d in autocast), default=0.0)
    return max(FLOOR, eps), max(CEILING, 8 * eps)


@dataclass
class Verdict:
    """The comparison: per step (samples equal, losses, relative difference, tolerance) and the
    outcome. Example::

        v = compare(one, many, reordered, again)
        v.passed, v.first_divergent, v.cause
    """

    passed: bool
    steps: List[Dict[str, Any]]
    largest: Optional[float]             # the largest relative difference seen (None: no steps)
    first_divergent: Optional[int] = None
    cause: str = ""                      # short name of the diagnosis
    why: str = ""                        # one sentence: what differs and what to do
    notes: List[str] = field(default_factory=list)  # what a PASS compared and did not
    evidence: List[str] = field(default_factory=list)  # what was observed for the cause
    autocast: List[str] = field(default_factory=list)  # low-precision dtypes seen
    floor: float = FLOOR                 # the least and the widest tolerance applied
    ceiling: float = CEILING
    nondeterministic: bool = False       # one process run twice already differed
    band: float = FLOOR                  # the tolerance at the first divergent step
    accum: int = 1                       # micro-batches a step of the 1-process runs took
    amplified: Optional[Tuple[int, float]] = None  # (step, spread): from there rounding grows


def _params(a: Step, b: Step) -> float:
    """The parameters' difference, relative to their norm (sums of single tensors may be ~0)."""
    scale = max(a.param_norm, b.param_norm, 1e-30)
    worst = max((abs(x - y) for x, y in zip(a.param_sums, b.param_sums)), default=0.0)
    return max(worst / scale, relative(a.param_norm, b.param_norm))


def _difference(a: Step, b: Step) -> Dict[str, float]:
    lr = relative(a.lr, b.lr) if a.lr is not None and b.lr is not None else 0.0
    return {"loss": relative(a.loss, b.loss), "grad_norm": relative(a.grad_norm, b.grad_norm),
            "params": _params(a, b), "lr": lr}


def _spread(one: RunRecord, other: Optional[RunRecord]) -> List[float]:
    """The largest relative difference up to each step between two runs of one process."""
    out, worst = [], 0.0
    for i, step in enumerate(one.steps):
        if other is not None and i < len(other.steps):
            worst = max(worst, *_difference(step, other.steps[i]).values())
        out.append(worst)
    return out


def compare(one: RunRecord, many: RunRecord, reordered: Optional[RunRecord] = None,
            again: Optional[RunRecord] = None, steps: Optional[int] = None,
            eval_within: int = 0) -> Verdict:
    """Compare ``many`` (N processes) with ``one`` (1 process) step by step; ``reordered`` (one
    process, batches reversed) sets the tolerance, ``again`` (one process, repeated) tells
    non-determinism apart; ``steps`` were asked for, ``eval_within`` more were allowed to reach
    the first evaluation.

    Example::

        verdict = compare(load("v/n1"), load("v/n2"), load("v/r1"), load("v/a1"))
    """
    verdict = _steps(one, many, reordered, again)
    _explain(verdict, one, many, again, steps, eval_within)
    return verdict


def _steps(one: RunRecord, many: RunRecord, reordered: Optional[RunRecord],
           again: Optional[RunRecord]) -> Verdict:
    """The step-by-step table and its first divergent step (not yet explained)."""

    # Two runs of one process that differ only by the last bits (GPU atomics) widen the band;
    # anything above the floor is non-determinism.
    repeat = _spread(one, again)
    nondeterministic = again is not None and max(repeat, default=0.0) > bounds(one.autocast)[0]
    random = any(s.random_forward or s.random_loop for run in (one, many) for s in run.steps)
    order = _spread(one, None if random else reordered)  # random draws follow the sample order
    dtypes = sorted(set(one.autocast) | set(many.autocast))
    floor, ceiling = bounds(dtypes)
    band = [min(max(MARGIN * max(r, a), floor), ceiling) for r, a in zip(
        order, repeat if not nondeterministic else [0.0] * len(repeat))]
    # After the first evaluation (past the steps compared, no reordered run to measure the
    # noise there): only a difference beyond the widest band is evidence.
    band = [ceiling if s.after_eval else b for s, b in zip(one.steps, band)]
    rows, largest, first, amplified = [], 0.0, None, None
    for i, (a, b) in enumerate(zip(one.steps, many.steps)):
        diff = _difference(a, b)
        worst = max(diff.values())
        same_samples = None if a.samples is None or b.samples is None else a.samples == b.samples
        ok = worst <= band[i] and same_samples is not False
        # After step 1, 1 process with its batches reversed parting by more than the widest band
        # is the training amplifying rounding, step after step: within that, no evidence.
        noise = MARGIN * max(order[i], repeat[i] if not nondeterministic else 0.0)
        drowned = i > 0 and noise > ceiling and worst <= noise and same_samples is not False
        drowned = drowned or (a.after_eval and amplified is not None)  # grown further still
        amplified = i if drowned and amplified is None else amplified
        largest = max(largest, worst) if amplified is None else largest
        rows.append({"step": a.step, "samples_equal": same_samples, "loss_1": a.loss,
                     "loss_n": b.loss, "relative": worst, "tolerance": band[i],
                     "verdict": "ok" if ok else "noise" if drowned else "DIVERGES",
                     "after_eval": a.after_eval,
                     **{f"rel_{k}": v for k, v in diff.items()}})
        if not ok and not drowned and first is None:
            first = i
    verdict = Verdict(passed=first is None and not nondeterministic, steps=rows, largest=largest,
                      autocast=dtypes, floor=floor, ceiling=ceiling)
    verdict.first_divergent = rows[first]["step"] if first is not None else None
    verdict.nondeterministic = nondeterministic
    verdict.band = band[first] if first is not None else floor
    if amplified is not None:
        verdict.amplified = (rows[amplified]["step"], max(order[amplified:], default=0.0))
    return verdict


def _explain(verdict: Verdict, one: RunRecord, many: RunRecord, again: Optional[RunRecord],
             steps: Optional[int], eval_within: int) -> None:
    """Name the cause on its evidence: whole-run facts first (no step on N, every rank on the
    same samples, ranks holding different models), then the first divergent step, then what
    a run that agrees step by step can still get wrong (its data later, its evaluation, the
    metric it prints)."""
    from . import evidence, metrics
    from .diagnose import diagnose, loader_mismatch  # the causes, by what differs first

    nondeterministic = verdict.nondeterministic
    found = None if nondeterministic else (
        evidence.no_steps(one, many, steps or len(one.steps)) or
        evidence.datasets_differ(many) or evidence.same_samples(many)
        or evidence.ranks_differ(many))
    parted = None if nondeterministic or found is not None else evidence.replicas_part(many)
    if parted is not None and (verdict.first_divergent is None or
                               parted[0] <= verdict.first_divergent):
        found = parted[1]  # the ranks parted no later than 1 and N did: the earliest evidence
    if found is None and (nondeterministic or verdict.first_divergent is not None):
        index = next(i for i, r in enumerate(verdict.steps)
                     if r["step"] == verdict.first_divergent) \
            if verdict.first_divergent is not None else None
        cause, why = diagnose(one, many, index, again if nondeterministic else None,
                              verdict.band)
        facts = evidence.repeat_facts(one, again) if nondeterministic and again else \
            evidence.step_facts(one, many, index)
        found = (cause, why, facts)
    if found is None:  # the steps agree: the data later, the evaluation, a printed metric
        planned = evidence.epoch_samples(one, many)  # observed: the epoch's samples differ
        later = loader_mismatch(one, many, f"the steps compared agree but {planned}") \
            if planned else None
        if planned and later is None:
            later = ("samples", f"the steps compared agree but {planned}: look at how the "
                                "script builds its rt.loader on N processes")
        found = (*later, [f"rt.loader: {planned}", "rt.loader's settings per rank: " + "; ".join(
            str(loader) for loader in many.loaders)]) if later else None
        found = found or evidence.evaluation(one, many) or \
            metrics.summed_metric(one, many) or metrics.printed_differs(one, many, again,
                                                                         verdict.band)
    if found is not None:
        verdict.passed = False
        verdict.cause, verdict.why, verdict.evidence = found
        if verdict.cause in ("no-steps", "same-samples", "ranks-differ", "evaluation",
                             "metric-summed", "printed-metric"):
            verdict.first_divergent = None
        return
    verdict.notes = evidence.what_was_compared(one, many, eval_within) + \
        metrics.printed_notes(one, many, again, verdict.band)
    if verdict.amplified is not None:
        step, spread = verdict.amplified
        verdict.notes[0] = f"{step - 1} optimizer step(s)"
        verdict.notes.insert(1, f"steps {step} to {verdict.steps[-1]['step']} not compared: 1 "
                                f"process with its batches reversed already parts from itself "
                                f"by up to {spread:.1e} there (the training amplifies float "
                                "rounding step after step); fewer --steps, or a smaller "
                                "learning rate, compare more")
    twice = evidence.gradient_collectives(many)
    if twice:
        verdict.notes.append(f"the script reduces gradients itself at {twice[0]['site']} on "
                             "top of DDP: no effect on the result here, twice the traffic")

