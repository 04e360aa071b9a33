"""Why N processes do not compute what one does: the first thing that differs at the first
divergent step names the cause (samples, then the loss before any update differs, then the
gradients, then the step), using what the probe saw on every rank.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Tuple

from .compare import relative
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
    for check in (_wrong_micro_step, _samples, _update):  # exact: no tolerance
        found = check(one, many, a, b)
        if found is not None:
            return found
    for within in (_loss, _gradients):  # beyond the step's tolerance
        found = within(one, many, a, b, tolerance)
        if found is not None:
            return found
    return ("unknown", f"step {a.step} differs but the samples, the loss, the gradient norm and "
                       "the learning rate agree: something outside the optimizer's parameters "
                       "changes the model")


def _nondeterministic(one: RunRecord, again: RunRecord) -> Diagnosis:
    if not one.seeded or sorted(set(one.seeds)) != sorted(set(again.seeds)):
        return ("unseeded", "one process run twice already differs, and the script does not "
                            "seed (Python's and NumPy's generators start from a fresh seed each "
                            "run): pass ddpkit.setup(seed=0)")
    step = next((a.step for a, b in zip(one.steps, again.steps)
                 if (a.loss, a.grad_norm, a.lr, a.param_sums) !=
                 (b.loss, b.grad_norm, b.lr, b.param_sums)), 1)
    return ("nondeterministic", f"one process run twice with the same seed already differs at "
                                f"step {step}: non-deterministic kernels (atomics on a GPU, "
                                "cuDNN autotuning); pass ddpkit.setup(deterministic=True) and "
                                "verify again")


def _samples(one: RunRecord, many: RunRecord, a: Step, b: Step) -> Optional[Diagnosis]:
    if a.samples is None or b.samples is None:
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
        return ("loop-randomness", f"step {a.step}: the training loop draws random numbers "
                                   "between the batch and the forward (noise, mixup, a random "
                                   "crop in the loop), and each rank draws its own: draw them "
                                   "per sample in the dataset's __getitem__ (rt.loader seeds "
                                   "every sample the same on any number of processes under "
                                   "verify), or switch them off for the check")
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
    return ("mean-of-means", f"step {a.step}: the same samples give loss {a.loss:.6g} on 1 "
                             f"process and {b.loss:.6g} on {many.world_size}: the loss is a "
                             "mean of per-rank means over unequal shards (tokens or targets "
                             "per rank differ); reduce (sum, count) over ranks instead")


def _gradients(one: RunRecord, many: RunRecord, a: Step, b: Step,
               tolerance: float) -> Optional[Diagnosis]:
    if relative(a.grad_norm, b.grad_norm) <= tolerance:
        return None
    without = [set(names) for names in b.no_grad]
    if any(w != without[0] for w in without) or (a.no_grad and without
                                                 and set(a.no_grad[0]) != without[0]):
        names = sorted(set().union(*without) ^ set(a.no_grad[0] if a.no_grad else []) or
                       set().union(*without))
        return ("unused-parameters", f"step {a.step}: parameter(s) {', '.join(names[:4])} get "
                                     "no gradient on some ranks: their forward skips them "
                                     "there; make every rank use every parameter, or wrap "
                                     "with find_unused_parameters=True")
    return ("gradients", f"step {a.step}: the same samples and loss give gradient norm "
                         f"{a.grad_norm:.6g} on 1 process and {b.grad_norm:.6g} on "
                         f"{many.world_size}: a gradient hook, clipping or scaling that depends "
                         "on the number of processes")


def _update(one: RunRecord, many: RunRecord, a: Step, b: Step) -> Optional[Diagnosis]:
    if a.lr is not None and b.lr is not None and relative(a.lr, b.lr) > 1e-9:
        return ("learning-rate", f"step {a.step}: the learning rate is {a.lr:g} on 1 process "
                                 f"and {b.lr:g} on {many.world_size}: scaled by the number of "
                                 "processes? The global batch is the same, so keep the rate")
    return None
