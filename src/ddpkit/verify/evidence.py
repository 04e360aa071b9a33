"""What ``ddpkit verify`` observed, as facts a verdict prints, and the checks over a whole run
that need no divergent step: every rank on the same samples, ranks holding different models,
no step on N processes, an evaluation that saw fewer samples, a printed metric summed over
ranks, gradients reduced by the script on top of DDP.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from .metrics import accumulated
from .records import RunRecord, Step

__all__ = ["Finding", "step_facts", "repeat_facts", "same_samples", "ranks_differ",
           "datasets_differ", "replicas_part", "epoch_samples", "no_steps", "evaluation",
           "gradient_collectives", "what_was_compared"]

#: (cause, one sentence, the evidence lines)
Finding = Tuple[str, str, List[str]]


def _received(step: Step) -> str:
    per = [len(r) for r in step.rows]
    return f"{sum(per)} ({' + '.join(map(str, per))})" if len(per) > 1 else str(sum(per))


def step_facts(one: RunRecord, many: RunRecord, index: int) -> List[str]:
    """The evidence at step ``index`` (0-based): what each side's forward received, the loader's
    samples, the models at the first forward, random draws, the loss, the gradient norm.

    Example::

        step_facts(one, many, 0)   # ['samples the forward received: 64 on 1 process, ...', ...]
    """
    a, b = one.steps[index], many.steps[index]
    n = many.world_size
    facts = []
    if a.rows and b.rows and (a.received() or b.received()):
        common = sum((Counter(a.received()) & Counter(b.received())).values())
        facts.append(f"samples the forward received at step {a.step}: {_received(a)} on 1 "
                     f"process, {_received(b)} on {n}; {common} in common")
    if a.samples is not None and b.samples is not None:
        facts.append(f"rt.loader's samples at step {a.step}: "
                     f"{'the same' if a.samples == b.samples else 'different'} "
                     f"({len(a.samples)} and {len(b.samples)})")
    differ = ranks_differ(many)
    if many.states and all(many.states):
        facts.append("model tensors at the first forward: "
                     + ("identical on every rank" if differ is None else differ[1]))
    draws = [w for w, on in (("between a batch and its forward", a.random_loop or b.random_loop),
                             ("inside the forward", a.random_forward or b.random_forward)) if on]
    facts.append("random numbers drawn from torch, Python's random or NumPy: "
                 + (", ".join(draws) if draws else "none between a batch and its forward, none "
                    "inside the forward"))
    counts = [[c[1] for c in rank if c[0] == "mean"] for rank in b.loss_counts]
    if any(counts):
        facts.append(f"targets each rank's loss averaged over: "
                     f"{', '.join(str(sum(c)) for c in counts)} (1 process: "
                     f"{sum(c[1] for r in a.loss_counts for c in r if c[0] == 'mean')})")
    facts.append(f"loss {a.loss:.6g} on 1 process, {b.loss:.6g} on {n}; gradient norm "
                 f"{a.grad_norm:.6g} and {b.grad_norm:.6g}")
    return facts


def repeat_facts(one: RunRecord, again: RunRecord) -> List[str]:
    """The evidence when one process run twice differs: the model it starts from, the samples
    its forward received, the first step whose figures differ.

    Example::

        repeat_facts(one, again)   # ['model tensors at the first forward: the same ...', ...]
    """
    same_start = bool(one.states) and bool(again.states) and one.states[0] == again.states[0]
    facts = [f"model tensors at the first forward of two 1-process runs: "
             f"{'the same' if same_start else 'different'}; seeded: {one.seeded}; device: "
             f"{one.device}"]
    for a, b in zip(one.steps, again.steps):
        if a.received() != b.received() or (a.loss, a.grad_norm) != (b.loss, b.grad_norm):
            facts.append(f"step {a.step}: samples received "
                         f"{'the same' if a.received() == b.received() else 'different'}; "
                         f"loss {a.loss:.9g} and {b.loss:.9g}")
            break
    return facts


def same_samples(many: RunRecord) -> Optional[Finding]:
    """Every rank's forward received the same samples at every step compared: N devices doing
    the work of one.

    Example::

        same_samples(load("v/many"))   # ('same-samples', 'every rank trained on ...', [...])
    """
    if many.world_size < 2 or not many.steps:
        return None
    for step in many.steps:
        ranks = [sorted(r) for r in step.rows]
        if len(ranks) < 2 or len(ranks[0]) < 2 or any(r != ranks[0] for r in ranks):
            return None
    per = len(many.steps[0].rows[0])
    how = ("the batches come from a DataLoader of the script's own with no DistributedSampler"
           if many.foreign_loader else "every rank draws the same batches")
    return ("same-samples",
            f"every rank trained on the same samples at each of the {len(many.steps)} steps "
            f"compared ({per} a step, identical on all {many.world_size} ranks): "
            f"{many.world_size} processes do the work of one; {how}: take them from "
            "rt.loader(dataset, global_batch_size) (or a DistributedSampler)",
            [f"samples the forward received at step {s.step}: {_received(s)}, the same on "
             "every rank" for s in many.steps[:2]])


def ranks_differ(many: RunRecord) -> Optional[Finding]:
    """The ranks' models (parameters or buffers) differ at the first training forward.

    Example::

        ranks_differ(load("v/many"))   # ('ranks-differ', "buffer 'proj' differs ...", [...])
    """
    states = [s for s in many.states if s]
    if len(states) < 2:
        return None
    names = [k for k in states[0] if any(s.get(k) != states[0][k] for s in states[1:])]
    if not names:
        return None
    buffers = [k[len("buffer:"):] for k in names if k.startswith("buffer:")]
    params = [k for k in names if not k.startswith("buffer:")]
    shown = ", ".join(repr(k) for k in (params or buffers)[:3])
    kind = "parameter(s)" if params else "buffer(s)"
    fix = ("DDP copies rank 0's parameters at rt.wrap: something changes them per rank after "
           "it (a re-initialisation, a load on one rank)" if params else
           "DDP does not copy buffers from rank 0 with broadcast_buffers=False, and they were "
           "made per rank (a seed from the rank, a load on one rank)")
    return ("ranks-differ",
            f"at the first training forward the ranks hold different {kind} {shown} "
            f"({len(names)} tensor(s) in all): {fix}; build them the same on every rank (the "
            "same seed), or keep broadcast_buffers=True",
            [f"{kind} {shown}: checksums differ between rank 0 and another rank at step 1"])


def datasets_differ(many: RunRecord) -> Optional[Finding]:
    """The ranks' training datasets (``rt.loader``'s) hold other values at the same index.

    Example::

        datasets_differ(load("v/many"))   # ('ranks-differ', "rt.loader's dataset differs ...")
    """
    contents = [loader.get("contents") for loader in many.loaders]
    if len(contents) < 2 or any(c is None for c in contents):
        return None
    parted = [(rank, a[0]) for rank, c in enumerate(contents[1:], 1)
              for a, b in zip(contents[0], c) if a != b]
    if not parted:
        return None
    rank, index = parted[0]
    return ("ranks-differ",
            f"rt.loader's dataset differs between ranks: sample {index} holds other values on "
            f"rank 0 and rank {rank}: rt.loader splits one dataset over the ranks, so every "
            "rank must build the same one (data drawn after a seed that includes the rank, a "
            "file per rank); build it alike on every rank, before any per-rank seeding",
            [f"rt.loader's dataset, samples {', '.join(str(c[0]) for c in contents[0])} "
             "(fetched with every generator seeded alike): checksums per rank " +
             "; ".join(",".join(str(c[1]) for c in rank_c) for rank_c in contents)])


def epoch_samples(one: RunRecord, many: RunRecord) -> Optional[str]:
    """The first epoch whose samples (what ``rt.loader`` hands out in it, all ranks together)
    differ between 1 and N processes, said in a line; None when every epoch both runs started
    agrees. Observed data, beyond the steps compared (``drop_last`` cutting another tail).

    Example::

        epoch_samples(one, many)   # 'epoch 0 hands out 1438 samples on 1 process, 1408 on 2 ...'
    """
    for epoch in sorted(set(one.plans) & set(many.plans)):
        (n1, h1), (nn, hn) = one.plans[epoch], many.plans[epoch]
        if (n1, h1) != (nn, hn):
            return (f"epoch {epoch} hands out {n1} samples on 1 process and {nn} on "
                    f"{many.world_size}" + (" (other samples)" if n1 == nn else ""))
    return None


def replicas_part(many: RunRecord) -> Optional[Tuple[int, Finding]]:
    """The replica invariant: after every compared optimizer step each rank must hold the same
    parameters, optimizer state, learning rates and module modes. The first step where they
    part, and the first quantity that does, by its path; None while they agree. (Buffers are
    left to the first forward: DDP hands rank 0's to every rank at each forward, so BatchNorm's
    running statistics differ after a step by design.)

    Example::

        replicas_part(load("v/many"))   # (3, ('ranks-differ', "after step 3 ...", [...]))
    """
    for step in many.steps:
        ranks = [r for r in step.replicas if r]
        if len(ranks) < 2:
            continue
        keys = [k for k in ranks[0] if not k.startswith("buffer:") and all(k in r for r in ranks)]
        differ = [k for k in keys if any(r[k] != ranks[0][k] for r in ranks[1:])]
        if differ:
            return step.step, _parted(step.step, differ, ranks)
    return None


def _parted(step: int, differ: List[str], ranks: List[Dict[str, Any]]) -> Finding:
    kinds = {"training:": "module mode", "lr:": "learning rate", "optimizer:": "optimizer state"}
    first = next((k for prefix in kinds for k in differ if k.startswith(prefix)), differ[0])
    kind = next((v for prefix, v in kinds.items() if first.startswith(prefix)), "parameter")
    name = first.split(":", 1)[1] if kind != "parameter" else first
    values = ", ".join(f"rank {i}: {r[first]}" for i, r in enumerate(ranks)) \
        if kind in ("module mode", "learning rate") else ""
    said = {"module mode": f"the module {name!r} is in training mode on some ranks and in "
                           f"evaluation mode on others ({values}): a model.eval() or "
                           ".train() that not every rank reached",
            "learning rate": f"{name}'s learning rate differs between ranks ({values}): a "
                             "scheduler or an lr set that not every rank ran alike",
            "optimizer state": f"the optimizer's state {name!r} differs between ranks",
            "parameter": f"the parameter {name!r} differs between ranks"}[kind]
    return ("ranks-differ",
            f"after optimizer step {step} the ranks no longer hold the same replica: {said} "
            f"({len(differ)} quantity(ies) in all); every rank must run the same updates on the "
            "same model",
            [f"replica invariant after step {step}: {kind} {name!r} differs between ranks"
             + (f" ({values})" if values else ""),
             "differs: " + ", ".join(differ[:6]) + (" ..." if len(differ) > 6 else "")])


def no_steps(one: RunRecord, many: RunRecord, steps: int) -> Optional[Finding]:
    """N processes took fewer optimizer steps than 1 (none at all, or stopped early): the
    data path drops batches on N.

    Example::

        no_steps(one, many, 10)   # ('no-steps', 'on 2 processes the script took no ...', [...])
    """
    if len(many.steps) >= min(steps, len(one.steps)) or not one.steps:
        return None
    facts = [f"rank {r}: rt.loader handed out {e.get('batches', 0)} batch(es), the model's "
             f"forward ran {e.get('forwards', 0)} time(s) on {e.get('rows', 0)} sample(s), "
             f"{e.get('step', 0)} optimizer step(s)" for r, e in enumerate(many.exits) if e]
    took = "no optimizer step" if not many.steps else f"only {len(many.steps)} step(s)"
    return ("no-steps",
            f"on {many.world_size} processes the script took {took} where 1 process took "
            f"{len(one.steps)}: its data path gives a rank's loop nothing to train on (a "
            "collate_fn or a filter that empties the batch, a loop that skips it, a per-rank "
            "batch of 0)", facts or ["no rank recorded what its loop did"])


def evaluation(one: RunRecord, many: RunRecord) -> Optional[Finding]:
    """The first evaluation saw fewer samples on N processes (all ranks together) than on 1.
    Counted, not matched: an evaluation set may augment at random. More on N (padding
    duplicates, each rank on the whole set) is no finding here.

    Example::

        evaluation(one, many)   # ('evaluation', 'the first evaluation saw 100 ...', [...])
    """
    if not one.evals or not one.evals[0]:
        return None
    seen_one = len(one.evals[0][0])
    per_rank = [len(rank[0]) if rank else None for rank in many.evals]
    seen_many = sum(n for n in per_rank if n is not None)
    if not seen_one or seen_many >= seen_one:
        return None
    who = ", ".join(f"rank {i}: {n}" if n is not None else f"rank {i}: none"
                    for i, n in enumerate(per_rank))
    alone = [i for i, n in enumerate(per_rank) if n is not None]
    how = (f"only rank {alone[0]} evaluates, on its own shard" if len(alone) == 1 else
           "the ranks' evaluation shards do not cover the evaluation set (drop_last, a "
           "per-rank subset)")
    return ("evaluation",
            f"the first evaluation saw {seen_many} samples on {many.world_size} processes and "
            f"{seen_one} on 1 ({who}): {how}; evaluate on every rank and reduce (sum, count), "
            "as rt.evaluate(model, dataset) does",
            [f"samples the first evaluation's forwards received: {seen_one} on 1 process; "
             f"{who} on {many.world_size}; {seen_one - seen_many} fewer"])


def gradient_collectives(many: RunRecord) -> List[Dict[str, Any]]:
    """The script's own collectives on parameters' gradients (rank 0, while training).

    Example::

        gradient_collectives(many)[0]["site"]   # 'train.py:51'
    """
    calls = many.collectives[0] if many.collectives else []
    return [c for c in calls if c.get("grad") and c.get("phase") == "train"]


_NAMES = {"torch": "torch's", "random": "Python's random", "numpy": "NumPy's"}


def augmentation_notes(one: RunRecord, many: RunRecord) -> List[str]:
    """What verify changed to compare augmentation, and what it saw of the script's own
    draws: each sample seeded on its own; ranks whose generators stand alike as the dataset
    draws from them (in the script's own runs every rank then augments with the same numbers).

    Example::

        augmentation_notes(one, many)   # ["the dataset draws from NumPy's generator: ...", ...]
    """
    loader = one.loaders[0] if one.loaders else {}
    if loader.get("seed_each_sample"):
        return ["augmentation compared as the script draws it: rt.loader(seed_each_sample=True)"]
    if not one.draws and not many.draws:
        if loader.get("num_workers"):  # what __getitem__ draws in a worker is out of sight
            return ["with DataLoader workers verify cannot see whether the dataset draws random "
                    "numbers: it seeded each sample's draws on its own (run seed, epoch, sample); "
                    "if the dataset augments, the script's own runs augment depending on the "
                    "number of processes: rt.loader(..., seed_each_sample=True) makes it the "
                    "same"]
        return []
    drawn = [g for g in _NAMES if g in set(one.draws) | set(many.draws)]
    names = " and ".join(f"{_NAMES.get(g, g)} generator" for g in drawn)
    notes = [f"the dataset draws from {names}: verify seeded each sample's draws on its own "
             "(run seed, epoch, sample) so 1 and N processes augment alike; in the script's "
             "own runs what a sample draws depends on the samples fetched before it, so on the "
             "number of processes: rt.loader(..., seed_each_sample=True) makes it the same"]
    streams = [s for s in many.streams if s]
    alike = [g for g in drawn if len(streams) > 1 and g in streams[0] and
             all(s.get(g) == streams[0][g] for s in streams[1:])]
    if alike:
        notes.append(f"warning: {', '.join(_NAMES.get(g, g) for g in alike)} generator stands "
                     f"alike on all {many.world_size} ranks as the dataset draws from it: in the "
                     "script's own runs every rank augments its samples with the same numbers "
                     "(seeded alike on every rank); seed it per rank, or pass "
                     "rt.loader(..., seed_each_sample=True)")
    return notes


def what_was_compared(one: RunRecord, many: RunRecord, eval_within: int) -> List[str]:
    """The notes a PASS carries: what was compared and what was not.

    Example::

        what_was_compared(one, many, 200)   # ['10 optimizer steps', ...]
    """
    notes = [f"{sum(not s.after_eval for s in one.steps[:len(many.steps)])} optimizer steps"]
    if one.steps and one.steps[0].samples is not None:
        notes.append("samples compared by rt.loader's indices and by what the forward received")
    elif any(s.received() for s in one.steps):
        notes.append("samples compared by what the model's forward received (the script's own "
                     "loader fed the batches)")
    else:
        notes.append("samples not compared: no tensor reached the model's forward")
    off = one.attention_off()
    if off or one.sdpa_dropout_off:
        sdpa = ", scaled_dot_product_attention's dropout_p" if one.sdpa_dropout_off else ""
        notes.append(f"dropout off for the comparison ({off} layer(s){sdpa})")
    if one.evals and one.evals[0]:
        notes.append(f"first evaluation compared ({len(one.evals[0][0])} samples)")
        after = [s.step for s, t in zip(one.steps, many.steps) if s.after_eval and t.after_eval]
        if after:
            notes.append(f"{len(after)} step(s) after it compared (step {after[0]}"
                         f"{f' to {after[-1]}' if len(after) > 1 else ''}, within the widest "
                         "tolerance)")
    elif eval_within:
        notes.append(f"evaluation not compared: none within {len(one.steps) + eval_within} "
                     "steps (--eval-within)")
    else:
        notes.append("evaluation not compared (--eval-within 0)")
    micro = accumulated(one)
    if micro and any(one.late_prints):
        notes.append(f"printed numbers not compared: 1 process accumulated {micro} "
                     "micro-batches a step, so what the loop holds as it prints (its last "
                     "loss, a running sum) is a micro-batch's")
    notes.extend(augmentation_notes(one, many))
    sites = sorted({c["site"] for rank in many.collectives for c in rank})
    if sites:
        notes.append(f"the script's own collectives at {', '.join(sites[:3])}: checked "
                     "against what rank 0 printed")
    return notes
