"""What the ranks of one ``ddpkit verify`` run recorded (``ddpkit.verify.probe``), merged per optimizer
step: the global samples, the global loss, the gradient norm, the parameters' digest.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Step", "RunRecord", "load", "relative"]


@dataclass
class Step:
    """One optimizer step of a run, over all of its ranks.

    Example::

        Step(1, samples=[0, 5, 9], loss=2.3, grad_norm=0.8, param_norm=4.9, param_sums=[0.1])
    """

    step: int
    samples: Optional[List[int]]      # every rank's samples, sorted; None: not from rt.loader
    loss: float                       # the mean over ranks of what each backpropagated
    grad_norm: float
    param_norm: float
    param_sums: List[float]
    lr: Optional[float] = None
    backwards: List[int] = field(default_factory=list)   # backward calls on each rank
    random_forward: bool = False      # a forward drew random numbers on some rank
    random_loop: bool = False         # the loop drew between a batch and its forward
    no_grad: List[List[str]] = field(default_factory=list)  # per rank: parameters without one
    epoch_end: bool = False           # the epoch's last batch was in this step
    rows: List[List[int]] = field(default_factory=list)  # per rank: what its forwards got
    loss_counts: List[List[Any]] = field(default_factory=list)  # per rank: (reduction, targets)
    replicas: List[Dict[str, Any]] = field(default_factory=list)  # per rank: after the step
    rank_losses: List[float] = field(default_factory=list)  # what each rank backpropagated
    after_eval: bool = False          # recorded after the first evaluation, past the steps
    rngs: List[Any] = field(default_factory=list)  # per rank: its generators after the step

    def received(self) -> List[int]:
        """Every rank's forward inputs together, one checksum per sample, sorted."""
        return sorted(d for rank in self.rows for d in rank)


@dataclass
class RunRecord:
    """Everything one run recorded. Example::

        run = load("/tmp/verify/n2")
        run.steps[0].loss
    """

    world_size: int
    steps: List[Step]
    seeds: List[int]                  # torch.initial_seed() of each rank after setup()
    seeded: bool                      # setup(seed=...) was given on every rank
    loaders: List[Dict[str, Any]]     # rt.loader's configuration, per rank (first loader)
    models: List[Dict[str, Any]]      # rank 0's wrapped models
    foreign_loader: bool              # a DataLoader of the script's own was iterated
    started: bool                     # setup() ran (the script is a ddpkit script)
    autocast: List[str] = field(default_factory=list)  # autocast dtypes a forward ran under
    states: List[Dict[str, int]] = field(default_factory=list)  # per rank: tensors at step 1
    evals: List[List[List[int]]] = field(default_factory=list)  # per rank, per evaluation
    collectives: List[List[Dict[str, Any]]] = field(default_factory=list)  # per rank
    prints: List[List[str]] = field(default_factory=list)  # per rank: the lines it printed
    late_prints: List[List[str]] = field(default_factory=list)  # after a step, nothing random
    eval_prints: List[List[str]] = field(default_factory=list)  # of those, after an evaluation
    print_models: Dict[str, Optional[List[float]]] = field(default_factory=dict)  # line: sums
    exits: List[Dict[str, Any]] = field(default_factory=list)  # per rank: batches, forwards
    sdpa_dropout_off: bool = False    # scaled_dot_product_attention's dropout_p was set to 0
    device: str = "cpu"               # where rank 0's model computed
    untrained: List[int] = field(default_factory=list)  # batches of passes that trained nothing
    plans: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # epoch: (samples, checksum)
    draws: List[str] = field(default_factory=list)  # generators the dataset drew from (no workers)
    streams: List[Dict[str, int]] = field(default_factory=list)  # per rank, at its first pass

    def attention_off(self) -> int:
        """Dropout layers turned off for the comparison (nn.Dropout and attention's)."""
        return sum(m.get("dropouts_off", 0) + m.get("attention_dropouts_off", 0)
                   for m in self.models)


def load(directory: str) -> RunRecord:
    """Read and merge ``directory/rank*.jsonl``.

    Example::

        load("/tmp/verify/n1").steps[-1].param_norm
    """
    ranks = sorted(int(n[4:-6]) for n in os.listdir(directory)
                   if n.startswith("rank") and n.endswith(".jsonl")) \
        if os.path.isdir(directory) else []
    events = [_read(os.path.join(directory, f"rank{r}.jsonl")) for r in ranks]
    starts = [e for rank in events for e in rank if e["event"] == "start"]
    per_rank = [[e for e in rank if e["event"] == "step"] for rank in events]
    count = min((len(s) for s in per_rank), default=0)
    ends = [{e["step"] for e in rank if e["event"] == "epoch_end"} for rank in events]
    steps = [_merge([s[i] for s in per_rank], ends) for i in range(count)]
    first = events[0] if events else []
    return RunRecord(
        world_size=len(ranks), steps=steps, seeds=[s["seed"] for s in starts],
        seeded=all(s.get("seeded", True) for s in starts),
        loaders=[next((e for e in rank if e["event"] == "loader"), {}) for rank in events],
        models=[e for e in first if e["event"] == "model"],
        foreign_loader=any(e["event"] == "foreign_loader" for rank in events for e in rank),
        started=bool(starts),
        autocast=sorted({e["dtype"] for rank in events for e in rank if e["event"] == "autocast"}),
        states=[next((e["digests"] for e in rank if e["event"] == "state"), {})
                for rank in events],
        evals=[[e["rows"] for e in rank if e["event"] == "eval"] for rank in events],
        collectives=[[e for e in rank if e["event"] == "collective"] for rank in events],
        prints=[[e["text"] for e in rank if e["event"] == "print"] for rank in events],
        late_prints=[[e["text"] for e in rank if e["event"] == "print" and e.get("step", 0) > 0
                      and not e.get("random")] for rank in events],
        eval_prints=[[e["text"] for e in rank if e["event"] == "print" and e.get("step", 0) > 0
                      and not e.get("random") and e.get("eval")] for rank in events],
        print_models={e["text"]: e.get("model") for e in reversed(first)
                      if e["event"] == "print"},
        exits=[next((e for e in rank if e["event"] == "exit"), {}) for rank in events],
        sdpa_dropout_off=any(e["event"] == "sdpa_dropout_off" for r in events for e in r),
        device=next((e.get("device", "cpu") for e in first if e["event"] == "state"), "cpu"),
        untrained=[e["batches"] for e in first if e["event"] == "untrained_pass"],
        plans=_plans(events),
        draws=sorted({g for r in events for e in r if e["event"] == "dataset_draws"
                      for g in e["generators"]}),
        streams=[next((e.get("streams", {}) for e in rank if e["event"] == "plan"), {})
                 for rank in events])


def _plans(events: List[List[Dict[str, Any]]]) -> Dict[int, Tuple[int, int]]:
    """Each epoch's samples over all ranks, from each rank's first pass of that epoch, less
    its padding: (count, order-free checksum); an epoch some rank did not start is left out."""
    per_rank = [{} for _ in events]  # type: List[Dict[int, Dict[str, Any]]]
    for mine, rank in zip(per_rank, events):
        for e in rank:
            if e["event"] == "plan":
                mine.setdefault(e["epoch"], e)
    epochs = set.intersection(*(set(p) for p in per_rank)) if per_rank else set()
    out = {}
    for epoch in sorted(epochs):
        plans = [p[epoch] for p in per_rank]
        count = sum(p["count"] for p in plans) - plans[0].get("padding", 0)
        total = sum(p["hash"] for p in plans) - plans[0].get("padding_hash", 0)
        out[epoch] = (count, total % (1 << 64))
    return out


def _read(path: str) -> List[Dict[str, Any]]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a rank killed mid-line: what it wrote before counts
                break
    return out


def _merge(records: List[Dict[str, Any]], ends: List[set]) -> Step:
    first = records[0]
    samples = sorted(i for r in records for i in r["samples"])
    n = first["step"]
    return Step(
        step=n, samples=samples or None,
        loss=sum(sum(r["losses"]) for r in records) / len(records),
        grad_norm=first.get("grad_norm", 0.0), param_norm=first["param_norm"],
        param_sums=first["param_sums"], lr=first.get("lr"),
        backwards=[len(r["losses"]) for r in records],
        random_forward=any(r.get("random_forward") for r in records),
        random_loop=any(r.get("random_loop") for r in records),
        no_grad=[r.get("no_grad", []) for r in records],
        epoch_end=any(n - 1 in e for e in ends),
        rows=[r.get("rows", []) for r in records],
        loss_counts=[r.get("loss_counts", []) for r in records],
        replicas=[r.get("replica", {}) for r in records],
        rank_losses=[sum(r["losses"]) for r in records],
        after_eval=bool(first.get("after_eval")), rngs=[r.get("rng") for r in records])


def relative(a: float, b: float) -> float:
    """``|a - b|`` relative to the larger of the two (0 for two zeros).

    Example::

        relative(1.0, 1.0001)   # 9.9990e-05
    """
    if math.isnan(a) or math.isnan(b):  # a NaN on one side only is as far as it gets
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0
