"""What ``fit`` is told: ``FitConfig`` (how to train), ``CheckpointPolicy`` (where and when to
save, what to resume) and ``Hook`` (what to call along the way); what it returns:
``TrainState``. ``ddpkit.training.loop`` runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from ..base.errors import DDPKitError
from .log import RunLogger
from .tracking import Tracking
from .precision import Precision

__all__ = ["CheckpointPolicy", "FitConfig", "Hook", "TrainState"]


@dataclass
class CheckpointPolicy:
    """Where and when to checkpoint, and what to resume from (``"auto"`` or a path).

    Example::

        CheckpointPolicy("runs/exp1/checkpoints", every_steps=100, resume="auto")
    """

    directory: str
    every_steps: Union[int, str] = 0  # "auto": Young/Daly from the measured save and the MTBF
    every_minutes: float = 0.0
    every_epoch: bool = True
    keep: int = 3
    resume: Optional[str] = None
    async_save: bool = False  # write in the background; the step waits only for a host copy
    mtbf_hours: float = 24.0  # expected time between failures, for every_steps="auto"


@dataclass
class FitConfig:
    """How :func:`fit` trains: epochs, loss, precision, accumulation, schedule, evaluation,
    logging, checkpoints, hooks. ``ddpkit train``'s :class:`~ddpkit.job.config.TrainConfig`
    maps onto it.

    Example::

        FitConfig(epochs=5, precision=Precision("bf16"), accum_steps=2, eval_data=test_set,
                  checkpoint=CheckpointPolicy("runs/exp1/checkpoints", resume="auto"))
        FitConfig(epochs=2, eval_data=val_tokens, eval_topk=(), perplexity=True)  # a language model

    The loss is ``loss_fn(logits, targets)`` (default: cross-entropy over logits of any shape
    ``(*, classes)``, ``-100`` targets ignored), the model's own ``.loss`` (Hugging Face models,
    when no ``loss_fn`` is given), or ``step(model, batch)``: a loss tensor, or ``{"loss": (sum,
    count), ...}`` whose other entries are also reported by evaluation.
    """

    epochs: int
    loss_fn: Optional[Callable[..., torch.Tensor]] = None  # default: cross-entropy, any shape
    step: Optional[Callable[[nn.Module, Any], Any]] = None  # model, batch -> loss or sums
    eval_topk: Sequence[int] = (1, 5)                       # () for none
    perplexity: bool = False                                # also exp(eval loss): language models
    precision: Optional[Precision] = None                  # default: fp32 on the rank's device
    accum_steps: int = 1
    clip_norm: Optional[float] = None
    scheduler: Any = None
    scheduler_interval: str = "epoch"                      # or "step"
    eval_data: Any = None
    eval_every: int = 1
    eval_batch_size: int = 256                             # per rank (evaluate's per_rank_batch)
    monitor: str = "top1"                                  # eval metric that picks the best epoch
    logger: Optional[Union[RunLogger, Tracking]] = None  # fit and `ddpkit train`: rt.tracking
    checkpoint: Optional[CheckpointPolicy] = None
    hooks: Sequence["Hook"] = ()
    max_steps: Optional[int] = None
    skip_nonfinite: bool = False
    channels_last: bool = False
    log_every: int = 20
    progress: bool = True
    config: Optional[Dict[str, Any]] = None                # stored in checkpoints

    def __post_init__(self) -> None:
        if self.scheduler_interval not in ("step", "epoch"):
            raise DDPKitError("scheduler_interval must be 'step' or 'epoch', not "
                              f"{self.scheduler_interval!r}")
        self.hooks = list(self.hooks)
        self.log_every = max(1, self.log_every)
        self.config = dict(self.config or {})


class Hook:
    """Override any of these to observe or extend the loop; ``loop`` is the running fit
    (``ddpkit.training.loop``'s, which imports this module: its model, optimizer, state, config).

    Example::

        class PrintLR(Hook):
            def on_epoch_end(self, loop, metrics):
                print(loop.optimizer.param_groups[0]["lr"])
    """

    def on_fit_start(self, loop: Any) -> None: ...
    def on_batch_end(self, loop: Any, batch: Any) -> None: ...
    def on_step_end(self, loop: Any, metrics: Dict[str, float]) -> None: ...
    def on_epoch_end(self, loop: Any, metrics: Dict[str, float]) -> None: ...
    def on_fit_end(self, loop: Any) -> None: ...


@dataclass
class TrainState:
    """Progress of a :func:`ddpkit.fit` run: completed epochs, optimizer steps, best metric,
    per-epoch history.

    Example::

        state = fit(...); print(state.best, state.history[-1])
    """

    epoch: int = 0
    step: int = 0
    best: Optional[float] = None
    best_epoch: Optional[int] = None
    history: List[Dict[str, float]] = field(default_factory=list)
