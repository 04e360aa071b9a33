"""Why N processes do not compute what one does: the first thing that differs at the first
divergent step names the cause (samples, what the forward received, then the loss before any
update differs, then the gradients, then the step), using what the probe saw on every rank. A
cause is named only on its own evidence; with none, the verdict is ``unexplained`` and says
which quantity differs first.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Tuple

from .records import relative
from .evidence import gradient_collectives
from .records import RunRecord, Step

__all__ = ["diagnose", "loader_mismatch"]

Diagnosis = Tuple[str, str]


def diagnose(one: RunRecord, many: RunRecord, index: Optional[int],
             again: Optional[RunRecord], tolerance: float = 1e-6) -> Diagnosis:
    """``(cause, one sentence)`` for the first divergent step ``index`` (0-based).

    Example::

        diagnose(load("v/n1"), load("v/n2"), 0, None)
        # ('batchnorm', 'the model has 2 BatchNorm layers: each rank normalises ...')
    """
    if again is not None:
        return _nondeterministic(one, again)
    a, b = one.steps[index], many.steps[index]
    for check in (_wrong_micro_step, _samples, _received, _update):  # exact: no tolerance
        found = check(one, many, a, b)
        if found is not None:
            return found
    for within in (_loss, _gradients):  # beyond the step's tolerance
        found = within(one, many, a, b, tolerance)
        if found is not None:
            return found
    return _unexplained(a, b, many, "the parameters after the step", _first_param(a, b),
                        "the samples, the loss, the gradient norm and the learning rate",
                        "what changes parameters besides the optimizer's step from these "
                        "gradients (an update by hand, a copy from another model, weight decay "
                        "applied by hand, an optimizer of the script's own)")


#: The stages a step goes through, in order: where 1 and N part first is the verdict's stage.
STAGES = ("the samples", "what the forward received", "the loss", "the gradients",
          "the learning rate", "the parameters after the step")


def _unexplained(a: Step, b: Step, many: RunRecord, stage: str, differs: str, agree: str,
                 where: str) -> Diagnosis:
    """``unexplained``, with the stage where 1 and N part, the quantity, what agrees before
    it and what the step's own records say (its loss calls, its own collectives)."""
    said = [f"step {a.step}: 1 and {many.world_size} processes first part at {stage} "
            f"({differs}); {agree} agree"]
    calls = _loss_calls(a, b, many.world_size)
    if calls:
        said.append(calls)
    return ("unexplained", "; ".join(said) + f": look at {where}")


def _loss_calls(a: Step, b: Step, n: int) -> str:
    """The step's cross_entropy/nll_loss calls on each side, as the probe counted them."""
    def side(calls: list) -> str:
        return ", ".join(f"{c[0]} over {c[1]} targets" for c in calls) or "none seen"
    if not any(a.loss_counts) and not any(b.loss_counts):
        return "no cross_entropy/nll_loss call seen: the loss is the script's own"
    ranks = "; ".join(f"rank {r}: {side(c)}" for r, c in enumerate(b.loss_counts))
    return (f"its loss calls: {side(a.loss_counts[0] if a.loss_counts else [])} on 1 process, "
            f"{ranks} on {n}")


def _first_param(a: Step, b: Step) -> str:
    for i, (x, y) in enumerate(zip(a.param_sums, b.param_sums)):
        if relative(x, y) > 1e-6:
            return f"the optimizer's parameter {i} sums to {x:.8g} and {y:.8g}"
    return f"their norm is {a.param_norm:.8g} and {b.param_norm:.8g}"


def _nondeterministic(one: RunRecord, again: RunRecord) -> Diagnosis:
    """One process run twice differs: what differed first between the two runs names why."""
    if one.states and again.states and one.states[0] != again.states[0]:
        names = [k for k in one.states[0] if one.states[0][k] != again.states[0].get(k)]
        if not one.seeded:
            return ("unseeded", f"one process run twice already differs: the model starts "
                                f"differently ({names[0]!r} among {len(names)}) and the script "
                                "does not seed: pass ddpkit.setup(seed=0)")
        return ("init-unseeded", f"one process run twice starts from different models "
                                 f"({names[0]!r} among {len(names)} tensors) though setup() is "
                                 "seeded: the initialisation draws from a generator of its own "
                                 "(NumPy, a torch.Generator, a clock): seed it or draw from torch")
    for a, b in zip(one.steps, again.steps):
        if a.received() != b.received():
            differ = sum((Counter(a.received()) - Counter(b.received())).values())
            return ("data-unseeded", f"one process run twice feeds the model other samples at "
                                     f"step {a.step} ({differ} of {len(a.received())} differ): "
                                     "the data order or augmentation draws from an unseeded "
                                     "generator (a torch.Generator or randperm without "
                                     "manual_seed, a clock): seed it, or take the batches from "
                                     "rt.loader(dataset, batch_size, seed=0)")
    if not one.seeded or sorted(set(one.seeds)) != sorted(set(again.seeds)):
        return ("unseeded", "one process run twice already differs, and the script does not "
                            "seed (Python's and NumPy's generators start from a fresh seed each "
                            "run): pass ddpkit.setup(seed=0)")
    step = next((a.step for a, b in zip(one.steps, again.steps)
                 if (a.loss, a.grad_norm, a.lr, a.param_sums) !=
                 (b.loss, b.grad_norm, b.lr, b.param_sums)), 1)
    if one.device == "cuda":
        return ("nondeterministic", f"one process run twice with the same seed, model and "
                                    f"samples already differs at step {step} on the GPU: "
                                    "non-deterministic kernels (atomics, cuDNN autotuning); "
                                    "pass ddpkit.setup(deterministic=True) and verify again")
    return ("unexplained", f"one process run twice with the same seed, the same starting model "
                           f"and the same samples already differs at step {step} on the "
                           f"{one.device}: something in the script is not repeatable (a "
                           "random draw outside torch's seeded generator, a clock, a file it "
                           "changes); look at what differs between two runs of it")


def _samples(one: RunRecord, many: RunRecord, a: Step, b: Step) -> Optional[Diagnosis]:
    if a.samples is None or b.samples is None:
        if a.received() or b.received():  # compared by what the forward received
            return None
        if one.foreign_loader or many.foreign_loader:
            return ("own-sampler", "the batches do not come from rt.loader (a DataLoader or "
                                   "sampler of the script's own), so ddpkit cannot split them "
                                   "the same on any number of processes: use "
                                   "rt.loader(dataset, global_batch_size)")
        return ("own-sampler", "the script draws its batches itself, not from rt.loader "
                               "(random windows or indices per rank, as nanoGPT does): N "
                               "processes train on other samples than 1 by design, equal only "
                               "in distribution; to compare exactly, take the batches from "
                               "rt.loader(dataset, global_batch_size)")
    if a.samples == b.samples:
        return None
    mismatch = loader_mismatch(one, many, f"step {a.step} uses other samples")
    if mismatch is not None:
        return mismatch
    missing = sum((Counter(a.samples) - Counter(b.samples)).values())
    extra = sum((Counter(b.samples) - Counter(a.samples)).values())
    tail = " (at the end of an epoch: padding of uneven shards)" if a.epoch_end or b.epoch_end \
        else ""
    return ("samples", f"step {a.step} uses other samples: {missing} of the 1-process step's "
                       f"{len(a.samples)} are missing and {extra} others taken{tail}")


def _received(one: RunRecord, many: RunRecord, a: Step, b: Step) -> Optional[Diagnosis]:
    """What the model's forward received differs, beyond the loader's samples."""
    got_a, got_b = a.received(), b.received()
    if got_a == got_b or not got_a and not got_b:
        return None
    n = many.world_size
    counts = (f"{len(got_a)} sample(s) on 1 process and {len(got_b)} on {n} "
              f"({', '.join(str(len(r)) for r in b.rows)} per rank)")
    if a.random_loop or b.random_loop:
        return _loop_randomness(a, many)
    if a.samples is not None and b.samples is not None:  # the loader agreed
        return ("data-path", f"step {a.step}: rt.loader handed out the same {len(a.samples)} "
                             f"samples on 1 and {n} processes, but the model's forward received "
                             f"{counts}: something between the loader and the model changes a "
                             "rank's batch (a collate_fn that trims or pads per batch, a filter "
                             "or transform in the loop); make it work per sample")
    common = sum((Counter(got_a) & Counter(got_b)).values())
    if one.foreign_loader or many.foreign_loader:
        return ("own-sampler", f"step {a.step}: the model received {counts}, {common} in "
                               "common: the batches come from a DataLoader or sampler of the "
                               "script's own, which does not split the 1-process batch over "
                               "the ranks (a per-process batch_size, another order): use "
                               "rt.loader(dataset, global_batch_size)")
    return ("own-sampler", f"step {a.step}: the model received {counts}, {common} in common: "
                           "the script draws its batches itself, not from rt.loader (random "
                           "windows or indices per rank, as nanoGPT does): N processes train "
                           "on other samples than 1 by design, equal only in distribution; to "
                           "compare exactly, take the batches from rt.loader(dataset, "
                           "global_batch_size)")


_ADVICE = {"global_batch": "give rt.loader the global batch (batch_size=), not a per-rank one "
                           "(per_rank_batch=), so a step takes the same samples on any number "
                           "of processes",
           "seed": "give every rank and every run the same seed= (not one from the rank or the "
                   "clock)",
           "drop_last": "pass the same drop_last= whatever the number of processes",
           "shuffle": "pass the same shuffle= whatever the number of processes"}


def loader_mismatch(one: RunRecord, many: RunRecord, what: str) -> Optional[Diagnosis]:
    """``rt.loader`` built differently on N processes than on 1 (seed from the rank, drop_last
    only when distributed, a per-rank batch): named even where the steps compared agree, since
    the data differs somewhere (a later epoch, the epoch's end).

    Example::

        loader_mismatch(one, many, "the data differs at the end of each epoch")
    """
    for key, fix in _ADVICE.items():
        mine = [str(loader.get(key)) for loader in one.loaders]
        theirs = [str(loader.get(key)) for loader in many.loaders]
        if set(mine) != set(theirs):
            said = theirs[0] if len(set(theirs)) == 1 else "per rank " + ", ".join(theirs)
            return (f"loader-{key}", f"{what}: rt.loader's {key}= is {mine[0]} on 1 process "
                                     f"and {said} on {many.world_size}: {fix}")
    return None


def _wrong_micro_step(one: RunRecord, many: RunRecord, a: Step,
                      b: Step) -> Optional[Diagnosis]:
    for run in (one, many):
        counts = [s.backwards[0] for s in run.steps if s.backwards and not s.epoch_end]
        if len(set(counts)) > 1:
            return ("accumulation-step", f"on {run.world_size} process(es) the optimizer "
                                         f"stepped after {counts[0]} micro-batch(es) at step 1 "
                                         f"and after {Counter(counts).most_common(1)[0][0]} "
                                         "usually: it steps on the wrong micro-step (step when "
                                         "(i + 1) % K == 0, or use ddpkit.Accumulator)")
    return None


def _loss(one: RunRecord, many: RunRecord, a: Step, b: Step,
          tolerance: float) -> Optional[Diagnosis]:
    if relative(a.loss, b.loss) <= tolerance:
        return None
    k_one, k_many = (a.backwards[0] if a.backwards else 1), (b.backwards[0] if b.backwards else 1)
    ratio = a.loss / b.loss if b.loss else 0.0
    if k_one != k_many and relative(ratio, k_one / k_many) < 1e-3:
        return ("accumulation-loss", f"the loss backpropagated per step is {ratio:g}x on 1 "
                                     f"process ({k_one} micro-batches) what it is on "
                                     f"{many.world_size} ({k_many} each): the accumulation does "
                                     f"not divide each micro-batch's loss by their number")
    if a.random_loop or b.random_loop:
        return _loop_randomness(a, many)
    if b.random_forward:
        return ("model-randomness", f"step {a.step}: the model's forward draws random numbers "
                                    "(a functional dropout, noise), which differ per rank: on N "
                                    "processes they are not the 1-process draws; use nn.Dropout "
                                    "modules (verify turns them off) or draw outside forward")
    norms = max((m.get("batchnorms", 0) for m in many.models), default=0)
    if norms and many.world_size > 1:
        return ("batchnorm", f"the model has {norms} BatchNorm layer(s): each rank normalises "
                             "with its own batch's statistics, so N processes are not one "
                             "process; use --sync-bn (rt.wrap(model, sync_bn=True), "
                             "SyncBatchNorm), or verify --accum-steps "
                             f"{many.world_size} to compare with the same micro-batches")
    for n in (many.world_size, 1 / many.world_size):
        if relative(b.loss / a.loss if a.loss else 0.0, n) < 1e-3:
            return ("loss-scale", f"the loss on {many.world_size} processes is {n:g}x the "
                                  "1-process loss: it is scaled by the number of processes")
    weights = [[c[2] for c in rank if len(c) > 2 and c[2] is not None] for rank in b.loss_counts]
    if weights and weights[0] and any(w != weights[0] for w in weights[1:]):
        return ("ranks-differ", f"step {a.step}: the loss's weight= (cross_entropy, nll_loss; "
                                "BCE's pos_weight=) differs between ranks: each rank weighs its targets with "
                                "other weights, so the ranks do not compute one loss; compute "
                                "the weights the same on every rank (from counts reduced over "
                                "ranks, or from the whole dataset)")
    counts = [sum(c[1] for c in rank if c[0] == "mean") for rank in b.loss_counts]
    divisors = [sum((c[3] if len(c) > 3 else c[1]) for c in rank if c[0] == "mean")
                for rank in b.loss_counts]
    if len(set(divisors)) > 1:
        over = f"{', '.join(map(str, counts))} targets" if len(set(counts)) > 1 else \
            f"targets whose weights sum to {', '.join(f'{d:.6g}' for d in divisors)}"
        return ("mean-of-means", f"step {a.step}: the same samples give loss {a.loss:.6g} on 1 "
                                 f"process and {b.loss:.6g} on {many.world_size}, and each "
                                 f"rank's loss is a mean over {over} (ignore_index, padding or "
                                 "class weights per rank differ): a mean of per-rank means; "
                                 "reduce (sum, divisor) over ranks instead")
    ranks = ", ".join(f"{x:.6g}" for x in b.rank_losses) if len(b.rank_losses) > 1 else ""
    return _unexplained(a, b, many, "the loss",
                        f"{a.loss:.6g} on 1 process, {b.loss:.6g} on {many.world_size}"
                        + (f" as the mean of the ranks' {ranks}" if ranks else ""),
                        "the samples, what the forward received and the model at the first "
                        "forward, with no random draw between a batch and its forward",
                        "how the loss is computed from a rank's batch: a term that is not a "
                        "mean over samples (a sum, a normaliser or regulariser per batch, "
                        "in-batch negatives) gives a rank's half batch another value")


def _loop_randomness(a: Step, many: RunRecord) -> Diagnosis:
    parted = _generators_part(many, a.step)
    if parted is not None:
        alike, apart = parted
        between = " (an evaluation ran between)" if a.after_eval else ""
        return ("ranks-differ", f"step {a.step}: the training loop draws random numbers between "
                                "the batch and the forward, and the ranks' random generators, "
                                f"alike after step {alike}, stand apart after step {apart}"
                                f"{between}: something drew random numbers on some ranks only "
                                "(an evaluation or a print under `if rank == 0:`; a DataLoader "
                                "iterated on one rank draws its seed from torch's generator); "
                                "draw alike on every rank, or draw the loop's numbers per "
                                "sample in the dataset (rt.loader(seed_each_sample=True))")
    return ("loop-randomness", f"step {a.step}: the training loop draws random numbers "
                               "between the batch and the forward (noise, mixup, a random "
                               "crop in the loop), and each rank draws its own: draw them "
                               "per sample in the dataset's __getitem__ (rt.loader seeds "
                               "every sample the same on any number of processes under "
                               "verify), or switch them off for the check")


def _generators_part(many: RunRecord, upto: int) -> Optional[Tuple[int, int]]:
    """(last step alike, first step apart) of the ranks' random generators up to step
    ``upto``, where they stood alike after the first step; else None."""
    steps = [s for s in many.steps if s.step <= upto and len(s.rngs) > 1 and None not in s.rngs]
    if not steps or len(set(steps[0].rngs)) > 1:
        return None
    for before, after in zip(steps, steps[1:]):
        if len(set(after.rngs)) > 1:
            return before.step, after.step
    return None


def _gradients(one: RunRecord, many: RunRecord, a: Step, b: Step,
               tolerance: float) -> Optional[Diagnosis]:
    if relative(a.grad_norm, b.grad_norm) <= tolerance:
        return None
    calls = [c for c in gradient_collectives(many) if c.get("step") == a.step - 1]
    if calls:
        return ("gradients-reduced-twice", f"step {a.step}: the script reduces parameter "
                                           f"gradients itself ({calls[0]['fn']}"
                                           f"({calls[0].get('op') or 'SUM'}) at "
                                           f"{calls[0]['site']}, {len(calls)} call(s) a step) "
                                           "on top of DDP, which already averages them: the "
                                           f"gradient norm is {b.grad_norm:.6g} on "
                                           f"{many.world_size} processes and {a.grad_norm:.6g} "
                                           "on 1; remove that loop (DDP does it)")
    without = [set(names) for names in b.no_grad]
    if any(w != without[0] for w in without) or (a.no_grad and without
                                                 and set(a.no_grad[0]) != without[0]):
        names = sorted(set().union(*without) ^ set(a.no_grad[0] if a.no_grad else []) or
                       set().union(*without))
        return ("unused-parameters", f"step {a.step}: parameter(s) {', '.join(names[:4])} get "
                                     "no gradient on some ranks: their forward skips them "
                                     "there; make every rank use every parameter, or wrap "
                                     "with find_unused_parameters=True")
    own = [c for rank in many.collectives for c in rank if c.get("step") == a.step - 1]
    return _unexplained(a, b, many, "the gradients",
                        f"norm {a.grad_norm:.6g} on 1 process, {b.grad_norm:.6g} on "
                        f"{many.world_size}", "the samples and the loss",
                        "what touches the gradients between backward and the step: "
                        + (f"the script's own {own[0]['fn']} at {own[0]['site']}, " if own else
                           "no collective of the script's own was seen; ")
                        + "a gradient hook, clipping or scaling")


def _update(one: RunRecord, many: RunRecord, a: Step, b: Step) -> Optional[Diagnosis]:
    if a.lr is None or b.lr is None or relative(a.lr, b.lr) <= 1e-9:
        return None
    n = many.world_size
    said = f"step {a.step}: the learning rate is {a.lr:g} on 1 process and {b.lr:g} on {n}"
    for factor, name in ((n, f"{n}x"), (n ** 0.5, f"sqrt({n})x")):
        if a.lr and relative(b.lr / a.lr, factor) < 1e-6:
            return ("learning-rate", f"{said}, {name} the 1-process rate: it is scaled by the "
                                     "number of processes; the global batch is the same, so "
                                     "keep the rate")
    pace = _schedule_pace(one, many)
    if pace is not None:
        faster, times = pace
        return ("learning-rate", f"{said}: the schedule runs {times}x as fast on {faster} "
                                 "(its learning rate after k optimizer steps is the other's "
                                 f"after {times}k): the scheduler is stepped per batch or "
                                 "micro-batch, whose number per optimizer step depends on the "
                                 "processes; step it once per optimizer step")
    return ("learning-rate", f"{said} (the first stage that differs: the learning rate the "
                             "optimizer applied; the samples agree): look at what sets it "
                             "between steps (a scheduler, a warm-up, lr set by hand)")


def _schedule_pace(one: RunRecord, many: RunRecord) -> Optional[Tuple[str, int]]:
    """(which run's schedule is ahead, how many times) when one run's learning rates are the
    other's at every c-th step, for a c from 2 to 8; else None."""
    runs = {"1 process": [s.lr for s in one.steps], f"{many.world_size} processes":
            [s.lr for s in many.steps]}
    for (fast, lr_fast), (_, lr_slow) in (tuple(runs.items()), tuple(runs.items())[::-1]):
        for times in range(2, 9):
            pairs = [(lr_fast[k - 1], lr_slow[times * k - 1]) for k in range(1, len(lr_slow) + 1)
                     if times * k <= len(lr_slow)]
            if pairs and all(x is not None and y is not None and relative(x, y) < 1e-9
                             for x, y in pairs):
                return fast, times
    return None
