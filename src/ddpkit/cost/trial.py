"""Trying comm hooks on real steps: one DDP comm hook that hands each gradient bucket to one of
several candidate hooks, a few steps each, times the steps, and keeps the fastest.

``comm_hook="auto"`` (``ddpkit.cost.auto``) uses it when the cost model's best two hooks are close
enough that the model's error could swap them: a step of the model's choice and of the runner-up
is measured where it counts, inside the user's own training step (data, forward, backward,
optimizer), not in isolation.

A step's time is the time between the hook's calls for the first bucket of consecutive steps.
The candidates take turns (A B A B: ``rounds`` rounds, each candidate ``warmup`` + ``steps``
steps a round, the warm-up steps not timed), so a machine that slows down or speeds up meanwhile
weighs on both alike; at the next step's first bucket every rank agrees on the slowest rank's
medians (one all-reduce, before that bucket's own) and all keep the same hook from then on. The
schedule is a count of steps, the same on every rank: ranks never use different hooks in one
step.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["HookTrial", "dispatch"]


class HookTrial:
    """State of the trial, registered with :func:`dispatch` as one DDP comm hook.

    Example::

        trial = HookTrial(["bf16", "powersgd"], [comm_hook_for("bf16"), comm_hook_for("powersgd")],
                          done=lambda name, medians: print(name, medians))
        ddp_model.register_comm_hook(trial, dispatch)
    """

    def __init__(self, names: Sequence[str], hooks: Sequence[Tuple[Any, Callable]],
                 done: Callable[[int, List[float]], None], steps: int = 3,
                 warmup: int = 1, rounds: int = 2, group: Any = None,
                 handicaps: Optional[Sequence[float]] = None) -> None:
        if len(names) != len(hooks) or not hooks:
            raise ValueError("a trial needs a name for each of one or more hooks")
        # each candidate's median is multiplied by its handicap before the fastest is kept
        self.handicaps = list(handicaps or [1.0] * len(hooks))
        self.names, self.hooks, self.done = list(names), list(hooks), done
        self.group = group
        # per step: (candidate, timed?) in turns
        self.schedule = [(j, i >= warmup) for _ in range(rounds) for j in range(len(hooks))
                         for i in range(warmup + steps)]
        self.active = 0                   # the candidate whose hook gets the buckets
        self.kept: Optional[int] = None   # the fastest, once decided
        self.medians: List[float] = []    # each candidate's median step (slowest rank)
        self._starts: List[float] = []    # when each step's first bucket reached the hook

    def first_bucket(self, device: torch.device) -> None:
        """A new step began: time it, switch candidate, or decide (collective at the decision)."""
        if self.kept is not None:
            return
        self._starts.append(time.perf_counter())
        step = len(self._starts) - 1
        if step < len(self.schedule):
            self.active = self.schedule[step][0]
            return
        t = self._starts
        mine = [statistics.median(t[k + 1] - t[k] for k, (who, timed) in enumerate(self.schedule)
                                  if who == j and timed) for j in range(len(self.hooks))]
        import torch.distributed as dist

        agreed = torch.tensor(mine, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        self.medians = agreed.tolist()
        self.kept = self.active = self.keep(self.medians, self.handicaps)
        self.hooks = [h if i == self.kept else (None, None)   # PowerSGD's error buffers go
                      for i, h in enumerate(self.hooks)]
        self.done(self.kept, self.medians)

    @staticmethod
    def keep(medians: Sequence[float], handicaps: Sequence[float]) -> int:
        """The candidate kept: the least median step times its handicap.

        Example::

            HookTrial.keep([0.100, 0.090], [1.0, 1.15])   # 0: 10% faster is not 15%
        """
        return min(range(len(medians)), key=lambda i: medians[i] * handicaps[i])


def dispatch(trial, bucket):  # type: ignore[no-untyped-def]
    """The DDP comm hook of a :class:`HookTrial`: each bucket to the active candidate's hook.
    Not annotated on purpose: DDP checks annotations against its own GradBucket/Future classes.

    Example::

        ddp_model.register_comm_hook(trial, dispatch)
    """
    if bucket.index() == 0:
        trial.first_bucket(bucket.buffer().device)
    state, hook = trial.hooks[trial.active]
    return hook(state, bucket)
