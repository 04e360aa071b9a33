"""``comm_hook="auto"``: choose the gradient compression from measurements, not by habit.

At the first training forward of a DDP model, before DDP runs it, every rank measures what the
step-time model (``ddpkit.cost.model``) needs, on this machine and this link:

- the forward + backward of the real batch on the local module (run aside: random generators,
  buffers and gradients are put back, so training is the same as without ``auto``);
- the link between the ranks: a short all-reduce sweep from 4 KiB, growing 4x until one takes
  ``budget_s`` (0.1 s: about 0.5 s at 10 Mbit/s), fitted to latency alpha and bandwidth beta;
- each hook's own cost apart from the link: the hook as DDP runs it, on buckets of the model's
  gradient shapes over a process group of one rank and, where short, over the real link (casts
  for bf16; error feedback, P = MQ, orthogonalisation, Q = M^T P and the per-tensor Python work
  for torch's PowerSGD, ranks 4 and 2; the same on one square matrix per bucket for the batched
  PowerSGD of ``ddpkit.cost.lowrank``, ranks 8 and 4).

The slowest rank's figures are agreed by all-reduce, so every rank makes the same choice: the
first of none, bf16, PowerSGD rank 4, rank 2, batched PowerSGD rank 8, rank 4 whose predicted
step is within 5% (and 1 ms) of the fastest (compression that does not pay is not used; a
higher rank, and a rank per tensor, are closer to exact), a PowerSGD only when it is also 15%
faster than none and bf16 (:data:`~ddpkit.cost.model.LOWRANK_GAIN`: it trades accuracy). When
it compresses and a hook of another kind is predicted within 2x of it, both are tried on the
first real steps (``ddpkit.cost.trial``: in turns, twice 1 + 3 steps each) and the faster is
kept, a PowerSGD only when 15% faster: the model's error cannot then cost more than those
steps. Two PowerSGDs are never tried against each other (each keeps an error memory
that taking turns would leave stale and then drop). The choice and its gain are one line from
rank 0, and :func:`choice_of` returns them.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .measure import probe_link, time_hooks, workload_of
from .trial import HookTrial, dispatch
from .model import (GAIN, LOWRANK_GAIN, Link, allreduce_seconds, hook_cost, lowrank,
                    step_time)

__all__ = ["Choice", "choose", "measure_step", "install", "choice_of", "OPTIONS",
           "POWERSGD_RANKS", "BATCHED_RANKS", "FLOOR_S", "runner_up", "TRIAL_FACTOR"]

#: PowerSGD ranks considered, the higher first (closer to the exact gradient).
POWERSGD_RANKS = (4, 2)
#: Batched PowerSGD's ranks considered, the higher first: one low-rank matrix for a whole bucket
#: is a coarser approximation than a rank per tensor. On the built-in job (3 seeds) rank 4
#: trained about as the per-tensor rank 2 (top-1 99.72 / 99.63 at batch 256, 99.35 / 99.72 at
#: 64), rank 8 as well (99.63, 99.72), and rank 2 lost 0.8-2 points: benchmarks/plan/accuracy.sh,
#: benchmarks/RESULTS.md.
BATCHED_RANKS = (8, 4)
#: Every (hook, PowerSGD rank) ``auto`` considers, in its order of preference when they tie:
#: the per-tensor PowerSGD before the batched one (cheaper to compute and to send).
OPTIONS = [("none", 0), ("bf16", 0)] + [("powersgd", r) for r in POWERSGD_RANKS] + \
    [("powersgd-batched", r) for r in BATCHED_RANKS]
#: A hook must save this much a step, besides 5% of it: below, the saving is timing noise.
FLOOR_S = 1e-3
#: A hook is also timed over the real link when the model says a step of it takes less.
REAL_BUDGET_S = 0.25
#: The runner-up is tried on real steps when predicted within this factor of the choice.
TRIAL_FACTOR = 2.0
_ATTR = "_ddpkit_comm_hook_choice"


@dataclass(frozen=True)
class Choice:
    """What ``auto`` chose and why. Example::

        choice_of(model).hook, choice_of(model).gain   # ('powersgd', 21.4)
    """

    hook: str              # none | bf16 | powersgd | powersgd-batched
    rank: int              # PowerSGD's matrix rank (0 for the others)
    predicted_s: float     # predicted step with this hook
    plain_s: float         # predicted step, gradients all-reduced uncompressed
    compute_s: float       # forward + backward measured (slowest rank)
    alpha_s: float         # the link's latency per hop
    beta: float            # the link's bandwidth, bytes/s
    ranks: int
    hook_s: Dict[str, float] = field(default_factory=dict)  # each hook's cost beside the link
    predicted: Dict[str, float] = field(default_factory=dict)  # each option's predicted step
    measured: Dict[str, float] = field(default_factory=dict)   # tried on real steps: median step

    @property
    def gain(self) -> float:
        """Predicted throughput gain over uncompressed all-reduce (0.25 = 25% faster)."""
        return self.plain_s / self.predicted_s - 1

    @property
    def name(self) -> str:
        return _label(self.hook, self.rank)

    def line(self) -> str:
        return self._figures() + self.trade()

    def trade(self) -> str:
        """What the chosen hook gives up: PowerSGD approximates the gradients (lossy, with
        error feedback); bf16 rounds them; none gives up nothing."""
        if lowrank(self.hook):
            return (f"; trades accuracy for speed: gradients approximated at rank {self.rank} "
                    "with error feedback (the built-in job lost up to 0.5 points of top-1 at "
                    "10 Mbit/s: benchmarks/RESULTS.md); compare with --comm-hook none")
        return "; gradients rounded to bf16 on the wire" if self.hook == "bf16" else ""

    def _figures(self) -> str:
        if self.measured:
            others = ", ".join(f"{v * 1e3:,.1f} ms for {k}" for k, v in self.measured.items()
                               if k != self.name)
            return (f"comm hook auto: {self.name}: measured {self.measured[self.name] * 1e3:,.1f}"
                    f" ms a step against {others} (tried on real steps; predicted "
                    f"{self.predicted_s * 1e3:,.1f} ms vs {self.plain_s * 1e3:,.1f} ms "
                    f"uncompressed); link {self.beta / 1e6:,.1f} MB/s, "
                    f"{self.alpha_s * 1e6:,.0f} us a hop")
        gain = f"predicted step {self.predicted_s * 1e3:,.1f} ms vs {self.plain_s * 1e3:,.1f} " \
               f"ms uncompressed ({self.gain:+.0%})" if self.hook != "none" else \
               f"predicted step {self.plain_s * 1e3:,.1f} ms; no compression gains over 5%"
        return (f"comm hook auto: {self.name}: {gain}; measured on {self.ranks} ranks: "
                f"forward+backward {self.compute_s * 1e3:,.1f} ms, link "
                f"{self.beta / 1e6:,.1f} MB/s, {self.alpha_s * 1e6:,.0f} us a hop")

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "gain": self.gain}


def choose(work: Any, link: Link, ranks: int, hook_s: Dict[Tuple[str, int], float]) -> Choice:
    """The hook for ``work`` (a :class:`ddpkit.cost.measure.Workload`) on ``ranks`` ranks over
    ``link``, given each hook's measured compute ``hook_s[(hook, rank)]``; pure.

    Example::

        choose(work, LINKS["100mbit"], 2, {("bf16", 0): 0.001, ("powersgd", 2): 0.04})
    """
    steps = {(hook, r): step_time(work.compute_s, work.bucket_shapes, ranks, link, hook,
                                  max(r, 1), hook_s=hook_s.get((hook, r), 0.0)).total
             for hook, r in OPTIONS}
    hook, r = _simplest_close(steps, OPTIONS)
    whole = [o for o in OPTIONS if not lowrank(o[0])]  # the gradient sent whole
    if lowrank(hook) and min(steps[o] for o in whole) < steps[(hook, r)] * (1 + LOWRANK_GAIN):
        hook, r = _simplest_close(steps, whole)  # a PowerSGD only for a clear gain
    return Choice(hook, r, steps[(hook, r)], steps[("none", 0)], work.compute_s, link.alpha,
                  link.beta, ranks, {_label(h, k): s for (h, k), s in sorted(hook_s.items())},
                  {_label(h, k): s for (h, k), s in steps.items()})


def _simplest_close(steps: Dict[Tuple[str, int], float],
                    options: Sequence[Tuple[str, int]]) -> Tuple[str, int]:
    """The first of ``options`` within noise (5%, and 1 ms) of the fastest of them."""
    fastest = min(steps[o] for o in options)
    slack = max(fastest * GAIN, FLOOR_S)
    return next(o for o in options if steps[o] <= fastest + slack)


def runner_up(choice: Choice) -> Optional[Tuple[str, int]]:
    """The option worth trying against ``choice`` on real steps: the best predicted of the other
    hooks (not another PowerSGD when ``choice`` is one: see :func:`_family`) when ``choice``
    compresses and that one is predicted within :data:`TRIAL_FACTOR` of it; else None (a clear
    choice, or plain all-reduce: kept as DDP does it, exactly).

    Example::

        runner_up(choose(work, LINKS["100mbit"], 2, hook_s))   # ('bf16', 0)
    """
    if choice.hook == "none":
        return None
    best = min((o for o in OPTIONS if _family(o[0]) != _family(choice.hook)),
               key=lambda o: choice.predicted[_label(*o)])
    return None if choice.predicted[_label(*best)] > choice.predicted_s * TRIAL_FACTOR else best


def _family(hook: str) -> str:
    """The PowerSGDs are one family: each keeps an error memory (error feedback) that a trial
    taking turns with another would leave stale and then drop. Tried in turns, the per-tensor
    and the batched PowerSGD cost 0.6-1.4 points of top-1 on the built-in job (every trial
    kept the batched one; chosen without a trial, it lost none): RESULTS.md."""
    return "powersgd" if lowrank(hook) else hook


def _label(hook: str, rank: int) -> str:
    return f"{hook} (rank {rank})" if lowrank(hook) else hook


def measure_step(module: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]) -> float:
    """Seconds of forward + backward of this batch through ``module``, the second of two runs,
    with the random generators, buffers (BatchNorm statistics) and gradients put back after.

    Example::

        measure_step(net, (x,), {})
    """
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in module.buffers()]
    devices = _cuda_devices(module)
    elapsed = 0.0
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            for _ in range(2):
                for p in params:
                    p.grad = None
                start = time.perf_counter()
                loss = _scalar(module(*args, **kwargs))
                if loss is None:  # nothing to backpropagate from: forward counts 3 times
                    elapsed = 3 * (time.perf_counter() - start)
                    continue
                loss.backward()
                if devices:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)
    return elapsed


def install(ddp: nn.Module, make: Callable[..., Tuple[Any, Callable]],
            bucket_cap_mb: float = 25.0) -> None:
    """Make ``ddp`` (a DistributedDataParallel) choose its comm hook at its first training
    forward and register it; ``make(hook, powersgd_rank, group)`` gives a hook's ``(state,
    hook)`` over ``group`` (the DDP engine's ``comm_hook_for``). The engines call this for
    ``comm_hook="auto"``.

    Example::

        install(ddp, lambda hook, rank, group=None: comm_hook_for(hook, options, group))
    """
    def first_forward(module: nn.Module, args: Any, kwargs: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return None  # evaluation: wait for the first training step
        handle.remove()
        # the measurements draw random numbers: training's generators are put back after
        with torch.random.fork_rng(devices=_cuda_devices(module)):
            choice = _decide(module.module, args, kwargs, bucket_cap_mb, make)
        setattr(module, _ATTR, choice)
        other = runner_up(choice)
        if other is not None:   # close: try both on real steps, keep the faster
            _try(module, choice, [(choice.hook, choice.rank), other], make)
            return None
        if choice.hook != "none":
            module.register_comm_hook(*make(choice.hook, choice.rank))
        _say(choice)
        return None

    setattr(ddp, _ATTR, None)
    handle = ddp.register_forward_pre_hook(first_forward, with_kwargs=True)


def _try(ddp: nn.Module, choice: Choice, options: List[Tuple[str, int]],
         make: Callable[..., Tuple[Any, Callable]]) -> None:
    """Register a :class:`HookTrial` of ``options`` on ``ddp``; its decision updates the
    choice and is said in one line."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = []
    for hook, rank in options:
        state, fn = (None, default_hooks.allreduce_hook) if hook == "none" else make(hook, rank)
        if hasattr(state, "start_powerSGD_iter"):
            # compress from its second trial step: the first (a warm-up, not timed) may be
            # DDP's first, after which DDP rebuilds its buckets and a PowerSGD's memories would
            # no longer match them
            state.iter = state.start_powerSGD_iter - 1
        hooks.append((state, fn))
    labels = [_label(h, r) for h, r in options]

    def done(kept: int, medians: List[float]) -> None:
        hook, rank = options[kept]
        final = replace(choice, hook=hook, rank=rank, predicted_s=choice.predicted[labels[kept]],
                        measured=dict(zip(labels, medians)))
        setattr(ddp, _ATTR, final)
        _say(final)

    handicaps = [1 + LOWRANK_GAIN if lowrank(hook) else 1.0 for hook, _ in options]
    ddp.register_comm_hook(HookTrial(labels, hooks, done, handicaps=handicaps), dispatch)


def _say(choice: Choice) -> None:
    if torch.distributed.get_rank() == 0:
        print(choice.line(), flush=True)


def choice_of(model: nn.Module) -> Optional[Choice]:
    """What ``comm_hook="auto"`` chose for ``model`` (None before its first training step, or
    when it was not asked for).

    Example::

        model = rt.wrap(net, comm_hook="auto"); ...; print(choice_of(model).line())
    """
    while True:
        if isinstance(getattr(model, _ATTR, None), Choice):
            return getattr(model, _ATTR)
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner


def _decide(module: nn.Module, args: Any, kwargs: Any, bucket_cap_mb: float,
            make: Callable[..., Tuple[Any, Callable]]) -> Choice:
    import torch.distributed as dist

    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    compute = measure_step(module, args, kwargs)
    work = workload_of(module, compute, batch=1, cap=int(bucket_cap_mb * (1 << 20)))
    link = probe_link(device)
    hooks = OPTIONS[1:]  # every hook that compresses
    spent = time_hooks(work.bucket_shapes, hooks, make, device, dist.new_subgroups(1)[0])
    ranks = dist.get_world_size()
    # Over the real link too, where a step of the hook alone is short: what it costs there
    # beyond the link's alpha-beta time (its rounds' hand-offs, contention) is its cost as well.
    for hook, r in hooks:
        modeled = sum(allreduce_seconds(c, ranks, link) for c in
                      (hook_cost(hook, shapes, max(r, 1)) for shapes in work.bucket_shapes))
        if modeled < REAL_BUDGET_S:  # the same on every rank: the link is agreed
            real = time_hooks(work.bucket_shapes, [(hook, r)], make, device)[(hook, r)]
            spent[(hook, r)] = max(spent[(hook, r)], real - modeled)
    mine = [compute] + [spent[h] for h in hooks]
    agreed = torch.tensor(mine, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)   # the slowest rank sets the pace
    compute, *spent = agreed.tolist()
    work = replace(work, compute_s=compute)
    return choose(work, link, dist.get_world_size(), dict(zip(hooks, spent)))


def _cuda_devices(module: nn.Module) -> List[int]:
    return sorted({p.device.index or 0 for p in module.parameters() if p.is_cuda})


def _scalar(output: Any) -> Optional[torch.Tensor]:
    """A scalar to backpropagate from the model's output: the sum of its first floating tensor
    that requires grad (a tensor, or inside a tuple, list, dict or Hugging Face ModelOutput)."""
    if torch.is_tensor(output):
        return output.float().sum() if output.requires_grad else None
    items = output.values() if isinstance(output, dict) else \
        output if isinstance(output, (list, tuple)) else ()
    for item in items:
        found = _scalar(item)
        if found is not None:
            return found
    return None
