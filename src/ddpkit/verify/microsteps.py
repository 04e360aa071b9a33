"""``ddpkit verify --accum-steps K`` on one process: a loop written to step on every batch
accumulates K micro-batches per optimizer step instead, unchanged. Every optimizer's ``step()``
happens on its K-th call; ``zero_grad``, the scheduler's step and GradScaler's ``update`` only
right after a step that happened; clipping and ``GradScaler.unscale_`` only before one.

Nothing here runs unless the probe (``ddpkit.verify.probe``) installs it for such a run.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Dict, Optional

from torch import nn

from ..base.errors import ConfigError

__all__ = ["HoldBack"]


class HoldBack:
    """Counts each optimizer's ``step()`` calls and lets every ``accum``-th through.

    Example::

        HoldBack(2).install()   # then: opt.step() steps on its 2nd, 4th, ... call
    """

    def __init__(self, accum: int, trains: Callable[[Any], bool] = lambda optimizer: True
                 ) -> None:
        self.accum = accum
        self.trains = trains              # does this optimizer train a model compared?
        self.calls: Dict[int, int] = {}   # id(optimizer) -> its step() calls so far
        self._inside = False              # in a step that happens (ZeRO steps its inner one)

    def _counts(self, optimizer: Any = None) -> list:
        if optimizer is not None:
            return [self.calls.get(id(optimizer), 0)]
        return list(self.calls.values()) or [0]

    def stepping(self, optimizer: Any = None) -> bool:
        """Will the next ``step()`` of ``optimizer`` (of every optimizer) happen?"""
        return all((c + 1) % self.accum == 0 for c in self._counts(optimizer))

    def settled(self, optimizer: Any = None) -> bool:
        """Is ``optimizer`` (every optimizer) right after a step that happened, or before any?"""
        return all(c % self.accum == 0 for c in self._counts(optimizer))

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` as the user's loop calls it."""
        if self._inside or not self.trains(optimizer):  # stepped by another's; not compared
            return type(optimizer).step(optimizer, *args, **kwargs)
        self.calls[id(optimizer)] = self.calls.get(id(optimizer), 0) + 1
        if self.calls[id(optimizer)] % self.accum:
            return None
        self._inside = True
        try:
            return type(optimizer).step(optimizer, *args, **kwargs)
        finally:
            self._inside = False

    def check(self, optimizer: Any) -> None:
        """Refuse an optimizer made before ``ddpkit.setup()``: its steps cannot be held back."""
        if not self._inside and not getattr(optimizer, "_ddpkit_held", False) and \
                self.trains(optimizer):
            raise ConfigError("verify --accum-steps holds back optimizer steps from "
                              "ddpkit.setup() on: create the optimizer after setup()")

    def install(self) -> None:
        """Patch Optimizer, Module.zero_grad, LRScheduler.step and GradScaler for this run."""
        from torch.optim import Optimizer
        from torch.optim.lr_scheduler import LRScheduler
        hold = self
        init = Optimizer.__init__

        def held_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            return hold.step(optimizer, *args, **kwargs)

        def held_init(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            init(optimizer, *args, **kwargs)
            # a method bound from a plain function, as LRScheduler expects when it wraps it
            optimizer.step = types.MethodType(held_step, optimizer)
            optimizer._ddpkit_held = True

        def when(test: Any, method: Any, owner: Any = lambda obj: None) -> Any:
            def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
                return method(obj, *args, **kwargs) if test(owner(obj)) else None
            return call

        Optimizer.__init__ = held_init  # type: ignore[method-assign]
        Optimizer.zero_grad = when(self.settled, Optimizer.zero_grad,  # type: ignore
                                   lambda opt: opt)
        nn.Module.zero_grad = when(self.settled, nn.Module.zero_grad)  # type: ignore
        LRScheduler.step = when(self.settled, LRScheduler.step,  # type: ignore
                                lambda sched: getattr(sched, "optimizer", None))
        self._scaler()

    def _scaler(self) -> None:
        try:
            from torch.amp import GradScaler
        except ImportError:  # torch without torch.amp.GradScaler
            return
        hold, step = self, GradScaler.step
        unscale, update = GradScaler.unscale_, GradScaler.update

        def held_step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Optional[Any]:
            if not hold.stepping(optimizer):
                hold.calls[id(optimizer)] = hold.calls.get(id(optimizer), 0) + 1
                return None
            before = hold.calls.get(id(optimizer), 0)
            result = step(scaler, optimizer, *args, **kwargs)
            if hold.calls.get(id(optimizer), 0) == before:  # inf/NaN: the scaler skipped it
                hold.calls[id(optimizer)] = before + 1
            return result

        GradScaler.step = held_step  # type: ignore[method-assign]
        GradScaler.unscale_ = lambda scaler, opt: (  # type: ignore[method-assign]
            unscale(scaler, opt) if hold.stepping(opt) else None)
        GradScaler.update = lambda scaler, new_scale=None: (  # type: ignore[method-assign]
            update(scaler, new_scale) if hold.settled() else None)
