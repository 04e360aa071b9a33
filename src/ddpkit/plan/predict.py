"""``ddpkit plan``'s predictions: a model's gradient buckets and its measured compute time
(``.measure``) fed to the cost model (``ddpkit.cost.model``) for every node count and comm hook,
and the recommendation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..cost.measure import Workload
from ..cost.model import (DEFAULT_RANKS, GAIN, LOWRANK_GAIN, Link, StepTime, buckets, lowrank,
                          step_time)

__all__ = ["Row", "synthetic_workload", "predict", "recommend", "HOOKS", "GAIN", "MAX_PARAMS",
           "HOOK_SLICE"]

#: The largest ``--params`` plan models: DDP keeps the whole model, its gradients and optimizer
#: state on every rank (this many parameters are 800 GB of fp32 weights and gradients alone), and
#: the prediction walks every bucket (1e12 took 25 s here).
MAX_PARAMS = 10 ** 11
#: The parameters whose gradients a model known by its count has its hooks timed on (256 MB of
#: fp32 a rank); a larger one's hook times are scaled from them (its matrices are all alike).
HOOK_SLICE = 2 ** 26

#: The hooks compared, in the order of preference when they tie.
HOOKS = ("none", "bf16", "powersgd", "powersgd-batched")


def synthetic_workload(params: int, compute_s: float, batch: int) -> Workload:
    """A model known only by its parameter count: 1024 x 1024 matrices (stated in the output).

    Example::

        synthetic_workload(25_000_000, compute_s=0.3, batch=32)
    """
    matrices, rest = divmod(params, 1024 * 1024)
    shapes = [(1024, 1024)] * matrices + ([(rest,)] if rest else [])  # shapes only: no tensors
    grouped = tuple(tuple(shapes[i] for i in bucket)
                    for bucket in buckets([4 * math.prod(s) for s in shapes]))
    return Workload(f"{params:,} parameters as 1024x1024 matrices", grouped, params, compute_s,
                    batch)


@dataclass(frozen=True)
class Row:
    """One prediction: node count, hook, the step and what it gives. Example::

        Row(2, 8, "bf16", step, samples_per_s=1024.0, efficiency=0.93)
    """

    nodes: int
    ranks: int
    hook: str
    step: StepTime
    samples_per_s: float
    efficiency: float      # throughput per rank against one rank alone


def predict(work: Workload, nodes: Sequence[int], link: Link, per_node: int = 1,
            inside: Optional[Link] = None, hooks: Sequence[str] = HOOKS,
            rank: Optional[int] = None,
            flops_per_s: float = 1e11,
            hook_seconds: Optional[Dict[str, float]] = None,
            node_step: Optional[float] = None) -> List[Row]:
    """Every node count x hook. Ranks on one node talk over ``inside`` (default ``link``);
    across nodes the ring runs at the slower ``link``; ``hook_seconds`` the hooks' own compute
    as :func:`ddpkit.plan.calibrate.calibrate` measured it; ``rank`` PowerSGD's (default: each hook's own,
    ``cost.model.DEFAULT_RANKS``); ``node_step`` one node's whole step as measured (its ranks'
    all-reduce included): the one-node rows are that, plus each hook's modelled difference.

    Example::

        predict(workload, [1, 2, 4], LINKS["1gbit"], per_node=1)
    """
    alone = work.compute_s
    rows = []
    for count in nodes:
        ranks = count * per_node
        over = link if count > 1 else (inside or link)

        def modelled(hook: str) -> StepTime:
            # the buffers' broadcast between a node's own ranks is in its timed step already
            return step_time(work.compute_s, work.bucket_shapes, ranks, over, hook,
                             rank or DEFAULT_RANKS.get(hook, 2), flops_per_s,
                             hook_s=(hook_seconds or {}).get(hook),
                             buffer_bytes=work.buffer_bytes if count > 1 else 0)

        plain = modelled("none")
        for hook in hooks:
            step = modelled(hook)
            if count == 1 and ranks > 1 and node_step is not None:
                step = _measured_node(step, plain, node_step)
            rows.append(Row(count, ranks, hook, step, ranks * work.batch / step.total,
                            alone / step.total))
    return rows


def _measured_node(step: StepTime, plain: StepTime, node_step: float) -> StepTime:
    """One node's row from its measured step: the hook's modelled difference to plain
    all-reduce on top; what is not compute is the node's communication (its all-reduce and
    what the ranks waited for each other)."""
    # not held up to the separately timed compute: the two timings move apart by noise (a
    # ResNet-18 compute alone of 1.22-1.96 s in one run of 7 steps on a 2-core host)
    total = max(node_step + step.total - plain.total, 1e-9)
    compute = min(step.compute, total)
    waits = max(total - compute - step.hook_compute, 0.0)
    return StepTime(total, compute, max(waits, step.communication), waits, step.hook_compute,
                    step.buffers)


def recommend(rows: Sequence[Row], slow: Sequence[Row] = ()) -> Dict[int, Tuple[str, float]]:
    """Per node count: the hook to use and its gain over plain all-reduce (0 for "none"): the
    first in :data:`HOOKS` order within 5% of the fastest, as ``comm_hook="auto"`` chooses (the
    simpler, then the finer approximation, where the difference is within the model's noise;
    "none" when plain all-reduce is within 5%). ``slow``: the same rows predicted at the slow
    end of the measured compute; a simpler hook within 5% of the fastest there is kept too, so
    a finer one is picked only for a gain that holds over the compute's spread (a gain of 4-6%
    flipped the pick between runs whose medians differed by 2 ms). A PowerSGD is picked only
    when it is also :data:`~ddpkit.cost.model.LOWRANK_GAIN` (15%) faster than none and bf16 at
    the median, and still more than :data:`GAIN` (5%) faster at the slow end, a gain beyond the
    noise over the compute's whole spread; else the best of those two. (15% at the slowest of
    40-80 timed steps, one outlier, was a lottery: at 100 Mbit/s the batched PowerSGD's gain
    over bf16 there came out 12-17%, and the pick moved between runs.)

    Example::

        recommend(predict(work, [2], LINKS["100mbit"]))   # {2: ('powersgd', 3.1)}
    """
    out: Dict[int, Tuple[str, float]] = {}
    for nodes in sorted({r.nodes for r in rows}):
        mine = sorted((r for r in rows if r.nodes == nodes),
                      key=lambda r: HOOKS.index(r.hook) if r.hook in HOOKS else len(HOOKS))
        plain = next((r for r in mine if r.hook == "none"), mine[0])
        at_slow = [r for r in slow if r.nodes == nodes]
        close = _close(mine) | _close(at_slow)
        pick = next(r for r in mine if r.hook in close)
        if lowrank(pick.hook) and not (_pays(pick.hook, mine, LOWRANK_GAIN) and
                                       (not at_slow or _pays(pick.hook, at_slow, GAIN))):
            whole = [r for r in mine if not lowrank(r.hook)]  # the gradient sent whole
            close = _close(whole) | _close([r for r in at_slow if not lowrank(r.hook)])
            pick = next((r for r in whole if r.hook in close), pick)
        gain = pick.samples_per_s / plain.samples_per_s - 1
        out[nodes] = (pick.hook, gain) if pick.hook != "none" else ("none", 0.0)
    return out


def _pays(hook: str, rows: Sequence[Row], bar: float) -> bool:
    """Whether ``hook`` (a PowerSGD) is ``bar`` (a fraction) faster than every row that sends
    the gradient whole."""
    mine = max((r.samples_per_s for r in rows if r.hook == hook), default=0.0)
    whole = max((r.samples_per_s for r in rows if not lowrank(r.hook)), default=0.0)
    return mine >= whole * (1 + bar)


def _close(rows: Sequence[Row]) -> set:
    """The hooks within :data:`GAIN` of the fastest of ``rows``."""
    fastest = max((r.samples_per_s for r in rows), default=0.0)
    return {r.hook for r in rows if r.samples_per_s * (1 + GAIN) >= fastest}
