"""Gradient accumulation: K micro-batches, one all-reduce, one optimizer step.

On non-final micro-steps the forward *and* backward run inside the engine's ``no_sync`` (DDP's),
so gradients accumulate locally and are reduced once, on the boundary.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from ..engines import Engine, active
from ..base.errors import ConfigError
from .precision import Precision

__all__ = ["Accumulator"]


class Accumulator:
    """Drives micro-steps: ``no_sync`` off the boundary, loss / K, step + zero_grad on it.

    Example::

        acc = Accumulator(model, optimizer, Precision("bf16"), steps=4, clip_norm=1.0)
        for i, (x, y) in enumerate(loader):
            with acc.micro_step(last=(i == len(loader) - 1)):
                with acc.precision.autocast():
                    loss = loss_fn(model(x), y)
                acc.backward(loss)
            if acc.stepped:
                scheduler.step()
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 precision: Optional[Precision] = None, steps: int = 1,
                 clip_norm: Optional[float] = None, skip_nonfinite: bool = False,
                 engine: Optional[Engine] = None) -> None:
        if steps < 1:
            raise ConfigError(f"accumulation steps must be >= 1, got {steps}")
        self.model, self.optimizer, self.steps = model, optimizer, steps
        # The engine knows how to skip the all-reduce (DDP's no_sync) and when gradients are
        # averaged (Horovod: inside its optimizer); by default the one serving this process.
        self._engine = engine
        self.precision = precision or Precision("fp32")
        self.clip_norm = clip_norm
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0    # optimizer steps skipped for NaN/inf gradients
        self.skipped = False      # was the last optimizer step skipped?
        self.micro = 0            # micro-steps since the last optimizer step
        self.stepped = False      # did the last micro-step end with an optimizer step?
        self.optimizer_steps = 0
        self.grad_norm: Optional[float] = None

    @property
    def engine(self) -> Engine:
        """The engine asked about no_sync and averaging: the one given, else the one serving this
        process when asked (so an Accumulator made before ``setup()`` still asks the right one)."""
        return self._engine or active()

    def is_boundary(self, last: bool = False) -> bool:
        """Whether the coming micro-step ends an accumulation window."""
        return last or (self.micro + 1) % self.steps == 0

    @contextlib.contextmanager
    def micro_step(self, last: bool = False) -> Iterator[None]:
        """Context for one micro-batch's forward and backward; steps the optimizer on boundaries.

        ``last=True`` forces a step (end of epoch) so no gradients leak into the next epoch.
        """
        boundary = self.is_boundary(last)
        with self.engine.no_sync(self.model) if not boundary else contextlib.nullcontext():
            yield
        self.micro += 1
        self.stepped = boundary
        if boundary:
            with self.engine.synchronized(self.optimizer):
                self.skipped = (self.skip_nonfinite and self.precision.scaler is None
                                and not self._grads_finite())
                if self.skipped:
                    self.skipped_steps += 1   # gradients are all-reduced: every rank agrees
                else:
                    self.grad_norm = self.precision.step(self.optimizer, self.clip_norm,
                                                         self.model.parameters())
            self.optimizer.zero_grad()  # set_to_none is the default (and Horovod takes no args)
            self.optimizer_steps += 1
            self.micro = 0

    def _grads_finite(self) -> bool:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return all(bool(torch.isfinite(g).all()) for g in grads)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / K`` so K micro-batches add up to the mean over the full batch.

        Example::

            acc.backward(loss)
        """
        self.precision.backward(loss / self.steps if self.steps > 1 else loss)
