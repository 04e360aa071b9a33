"""A small training loop: ``fit`` runs epochs with accumulation, precision, eval and checkpoints.

Composable rather than a god object: it takes the pieces (runtime, model, optimizer, loader,
precision, scheduler, logger, hooks) that users can also drive by hand.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch import nn

from ..engines import comm
from .accumulate import Accumulator
from .batches import batch_size_of, channels_last, default_loss, forward, logits_of, step_sums, targets_of, to_device
from ..data.batch import Batch
from ..data.loader import DistributedLoader
from ..base.errors import ConfigError, DDPKitError
from .evaluation import perplexity
from .log import RunLogger, format_epoch, progress_bar
from .fitconfig import CheckpointPolicy, FitConfig, Hook, TrainState
from .precision import Precision
from ..checkpoint.checkpointer import Checkpointer
from .runtime import Runtime
from ..faults.stops import StopRequested

__all__ = ["TrainState", "CheckpointPolicy", "FitConfig", "Hook", "fit"]


def _adopt_accumulation(loader: Any, accum_steps: int) -> None:
    """The optimizer step's batch, one value (:class:`~ddpkit.data.batch.Batch`): a loader built
    without ``accum_steps`` that ``fit`` accumulates over takes ``accum_steps`` of its batches a
    step, so its value says so (what checkpoints and the progress line read); a loader built for
    another accumulation is refused in one line."""
    batch = getattr(loader, "batch", None)
    if batch is None or accum_steps <= 1 or batch.accum_steps == accum_steps:
        return
    if batch.accum_steps != 1:
        raise ConfigError(f"the loader was built with accum_steps={batch.accum_steps} but fit "
                          f"accumulates accum_steps={accum_steps}; give both the same value")
    loader.batch = Batch(batch.global_batch * accum_steps, batch.world_size, accum_steps,
                         batch.micro_batch)


class _Fit:
    """One call of :func:`fit`: the state and the steps of the loop, kept out of the user's way."""

    def __init__(self, rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loader: DistributedLoader, cfg: FitConfig) -> None:
        _adopt_accumulation(loader, cfg.accum_steps)
        # Under the Horovod engine the optimizer averages gradients (no-op for DDP, idempotent).
        optimizer = rt.optimizer(optimizer, model, cfg.accum_steps)
        self.rt, self.model, self.optimizer, self.loader, self.cfg = rt, model, optimizer, loader, cfg
        self.precision: Precision = cfg.precision or Precision("fp32", rt.device)
        self.acc = Accumulator(model, optimizer, self.precision, cfg.accum_steps, cfg.clip_norm,
                               skip_nonfinite=cfg.skip_nonfinite, engine=rt.engine)
        self.state = TrainState()
        # setup(log_to=...) or setup(log_dir=...): fit logs where rt.log does
        self.logger: Optional[Any] = cfg.logger if cfg.logger is not None else (
            rt.tracking if getattr(getattr(rt, "tracking", None), "chosen", False) else None)
        self.ckpt: Optional[CheckpointPolicy] = cfg.checkpoint
        self.checkpoints: Optional[Checkpointer] = None  # opened by run(): it may resume
        self.loss_fn: Callable[..., torch.Tensor] = cfg.loss_fn or default_loss
        self._step_gives_sums = True  # a step returning a bare loss is not used to evaluate
        self.start_position = (0, 0)   # (epoch, global samples done in it) where this run starts
        # This optimizer step's [loss sum, samples] over its micro-batches, on the device; the
        # reduction over ranks runs behind the optimizer step on the steps whose loss is read.
        self._window = torch.zeros(2, dtype=torch.float64, device=rt.device)
        # The epoch's [loss sum, samples] over the steps taken, all its samples, and the samples
        # this run trained (a resumed epoch's first three come back from its checkpoint)
        self._epoch_sums = torch.zeros(4, dtype=torch.float64, device=rt.device)
        self._carried: Optional[Dict[str, Any]] = None  # from the checkpoint, for its epoch
        self._epoch_steps = [0, 0]  # [optimizer steps, of them skipped (NaN/inf gradients)]
        self._pending: Any = None
        self._hooks_anywhere = False  # settled by every rank when the run starts

    # ------------------------------------------------------------------ checkpoints
    def _open_checkpoints(self) -> Checkpointer:
        """The run's :class:`Checkpointer` (also without a policy: it turns SIGTERM into a stop)."""
        p = self.ckpt
        best = {"best": None, "best_epoch": None}
        ckpt = Checkpointer(
            self.rt, p.directory if p else None, model=self.model, optimizer=self.optimizer,
            scheduler=self.cfg.scheduler, precision=self.precision, loader=self.loader,
            extra={"history": self.state.history, "best": best, "epoch_sums": _EpochSums(self)},
            every_epoch=False,
            every_steps=p.every_steps if p else 0, every_minutes=p.every_minutes if p else 0.0,
            keep=p.keep if p else 3, resume=p.resume if p else None, config=self.cfg.config,
            async_save=bool(p and p.async_save), mtbf_hours=p.mtbf_hours if p else 24.0)
        # the history list was restored in place (from a checkpoint, or from a live peer: a
        # fault-tolerant replica that joined a running job)
        if ckpt.resumed or ckpt.global_step:
            best = ckpt.extra["best"]
            self.state = TrainState(ckpt.epoch, ckpt.global_step, best["best"], best["best_epoch"],
                                    self.state.history)
        self.start_position = (ckpt.epoch, self.loader.state_dict()["samples_done"])
        self.checkpoints = ckpt
        return ckpt

    def save(self) -> Optional[Any]:
        return self.checkpoints.save() if self.checkpoints is not None else None

    # ------------------------------------------------------------------ training
    def _forward_backward(self, batch: Any, last: bool) -> torch.Tensor:
        batch = to_device(batch, self.rt.device)
        if self.cfg.channels_last:
            batch = channels_last(batch)
        boundary = self.acc.is_boundary(last)
        with self.acc.micro_step(last=last):
            with self.precision.autocast():
                loss = self._loss(batch)
            if self._check_every_micro_step:
                self._check_finite(loss.detach())
            n = batch_size_of(batch)
            self._window[0] += loss.detach().double() * n  # in place: no host-to-device copy
            self._window[1] += n
            self.acc.backward(loss)
            # Behind the optimizer step; after backward, so that when a peer is lost DDP's own
            # all-reduce is the collective that times out (and is named), not this one.
            if boundary and self._loss_read(self.state.step + 1):
                self._pending = self.rt.engine.start_all_reduce(self._window)
        return loss.detach()

    def _loss(self, batch: Any) -> torch.Tensor:
        """This micro-batch's training loss: the user's ``step``, the model's own ``.loss``
        (Hugging Face, when no ``loss_fn`` is given), or ``loss_fn(logits, targets)``."""
        if self.cfg.step is not None:
            result = self.cfg.step(self.model, batch)
            self._step_gives_sums = not torch.is_tensor(result)
            if torch.is_tensor(result) and result.numel() == 1:
                return result.reshape(())
            pairs = step_sums(result)
            if "loss" not in pairs:
                raise ConfigError(f"a training step must return a loss tensor or sums with a "
                                  f"'loss' entry; got {', '.join(pairs)}")
            total, count = pairs["loss"]
            return total / count.clamp(min=1)
        out = forward(self.model, batch)
        own = getattr(out, "loss", None)
        if self.cfg.loss_fn is None and torch.is_tensor(own):
            return own
        return self.loss_fn(logits_of(out), targets_of(batch))

    @property
    def _check_every_micro_step(self) -> bool:
        # Reading a loss forces a device sync: on CPU it is free, on GPUs only on logging steps.
        return not self.cfg.skip_nonfinite and self.rt.device.type == "cpu"

    def _check_finite(self, loss: torch.Tensor) -> float:
        value = float(loss)
        if not math.isfinite(value) and not self.cfg.skip_nonfinite:
            where = "at" if self._check_every_micro_step else "by"
            raise DDPKitError(
                f"loss is {value} {where} step {self.state.step + 1} (epoch "
                f"{self.state.epoch + 1}); lower --lr, set --clip-grad, or pass "
                "--skip-nonfinite to skip such steps")
        return value

    def train_epoch(self) -> Dict[str, float]:
        self.loader.set_epoch(self.state.epoch)  # a resume into this epoch keeps its place
        self.model.train()
        self._epoch_sums.zero_()  # on the device: no per-step sync
        self._epoch_steps = [0, 0]
        carried, self._carried = self._carried, None
        if carried and carried["epoch"] == self.state.epoch and self.rt.rank == 0:
            # resumed mid-epoch: the epoch's line covers the steps before the resume too
            self._epoch_sums[:3] += torch.tensor(carried["sums"], dtype=torch.float64,
                                                 device=self.rt.device)
        start = time.perf_counter()
        bar = progress_bar(self.loader, len(self.loader), f"epoch {self.state.epoch + 1}",
                       self.cfg.progress, self.loader.batch.per_micro_step)
        for batch in bar:
            loss = self._forward_backward(batch, self.loader.at_last_batch)
            for hook in self.cfg.hooks:
                hook.on_batch_end(self, batch)
            if self.acc.stepped:
                self._after_optimizer_step(loss, bar)
                if self._stop():
                    break
        bar.close()
        return self._epoch_metrics(time.perf_counter() - start)

    def _after_optimizer_step(self, loss_t: torch.Tensor, bar: Any) -> None:
        step = self.state.step + 1
        log_now = self.logger is not None and step % self.cfg.log_every == 0
        shown = getattr(bar, "disable", True) is False
        # The mean over ranks and the step's micro-batches, on the steps it was reduced for
        # (a device sync on GPUs, where someone looks at it); NaN on the others.
        loss = self._mean_loss() if self._pending is not None else float("nan")
        # An epoch's micro-batches all end in a step; a skipped step's loss is not trained on
        if not self.acc.skipped:
            self._epoch_sums[:2] += self._window
        self._epoch_sums[2:] += self._window[1]
        self._window.zero_()
        self._epoch_steps[0] += 1
        self._epoch_steps[1] += int(self.acc.skipped)
        if (log_now or self.cfg.hooks) and not self._check_every_micro_step:
            self._check_finite(loss_t)  # on CPU every micro-step was checked already
        self.state.step = step
        if self.cfg.scheduler is not None and self.cfg.scheduler_interval == "step":
            self.cfg.scheduler.step()
        metrics = {"train/loss": loss, "lr": self.optimizer.param_groups[0]["lr"]}
        if self.acc.grad_norm is not None:
            metrics["train/grad_norm"] = self.acc.grad_norm
        if shown and math.isfinite(loss):
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{metrics['lr']:.3g}")
        if log_now:
            self.logger.log(metrics, step)
        for hook in self.cfg.hooks:
            hook.on_step_end(self, metrics)
        # counts the step for hang reports, saves when due, stops every rank on SIGTERM
        self.checkpoints.step(step)
        # the job's count (a fault-tolerant replica: committed steps, a peer's after a heal)
        self.state.step = self.checkpoints.global_step

    def _loss_read(self, step: int) -> bool:
        # The same answer on every rank (the reduction is a collective): the logging steps
        # (the bar shows the latest), and every step where any rank's hooks get the metrics.
        return step % self.cfg.log_every == 0 or self._hooks_anywhere

    def _mean_loss(self) -> float:
        total, count = self._pending.tensor_result().tolist()
        self._pending = None
        return total / max(count, 1.0)

    def _stop(self) -> bool:
        return self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps

    def _epoch_metrics(self, seconds: float) -> Dict[str, float]:
        totals = comm.reduce(self._epoch_sums, "sum")
        wall = comm.reduce(seconds, "max")  # the slowest rank sets the pace
        taken, count = int(totals[1]), int(totals[2])
        steps, skipped = self._epoch_steps
        metrics = {"train/loss": float(totals[0]) / taken if taken else float("nan"),
                   "train/samples": count,
                   "train/samples_per_s": float(totals[3]) / max(wall, 1e-9),  # this run's
                   "train/step_ms": 1000 * wall / max(steps, 1), "train/epoch_s": wall}
        if self.cfg.skip_nonfinite:  # the same on every rank: gradients were all-reduced
            metrics["train/skipped_steps"] = skipped
        return metrics

    def evaluate(self) -> Dict[str, float]:
        if self.cfg.eval_data is None:
            return {}
        result = self.rt.evaluate(self.model, self.cfg.eval_data,
                                  per_rank_batch=self.cfg.eval_batch_size, loss_fn=self.cfg.loss_fn,
                                  precision=self.precision, channels_last=self.cfg.channels_last,
                                  step=self.cfg.step if self._step_gives_sums else None,
                                  topk=self.cfg.eval_topk)
        if self.cfg.perplexity and "loss" in result:
            result["perplexity"] = perplexity(result["loss"])
        return {f"eval/{k}": v for k, v in result.items()}

    def run(self) -> TrainState:
        # The checkpointer turns SIGTERM / SIGUSR1 into a stop after a step, with a checkpoint;
        # on leaving without an error, a signal during the last steps or the final evaluation
        # is still a stop (not on errors: the answer may never come).
        with self._open_checkpoints():
            try:
                return self._run()
            except StopRequested:
                if self.logger is not None:
                    self.logger.close()
                raise

    def _run(self) -> TrainState:
        # Hooks on some ranks only (a logger on rank 0, say) still get the mean over ranks
        self._hooks_anywhere = bool(comm.reduce(len(self.cfg.hooks), "max"))
        for hook in self.cfg.hooks:
            hook.on_fit_start(self)
        if self.checkpoints.resumed and (self.state.epoch >= self.cfg.epochs or self._stop()):
            self._say_complete()
        while self.state.epoch < self.cfg.epochs and not self._stop():
            metrics = self.train_epoch()
            if self._stop() and not self._epoch_finished():
                if self.checkpoints.saved_step != self.state.step:
                    self.save()  # stopped by max_steps mid-epoch: keep the work (unless just saved)
                self._end_run_mid_epoch(metrics)
                break
            self._end_epoch(metrics)
        for hook in self.cfg.hooks:
            hook.on_fit_end(self)
        if self.logger is not None:
            self.logger.close()
        return self.state

    def _say_complete(self) -> None:
        """Resumed with nothing left to train (a stop after the last step, or the same command
        again): one line; the run ends with the results its history holds. A run ended by
        max_steps mid-epoch saves before its final evaluation: that runs now if not recorded."""
        why = (f"end of epoch {self.state.epoch} of {self.cfg.epochs}"
               if self.state.epoch >= self.cfg.epochs else f"max_steps {self.cfg.max_steps}")
        comm.print0(f"the run is complete: {self.checkpoints.resumed} holds its last step "
                    f"(step {self.state.step}, {why}); nothing left to train")
        last = self.state.history[-1] if self.state.history else {}
        if self.state.epoch < self.cfg.epochs and self.checkpoints.mid_epoch and \
                last.get("stopped_at_step") != self.state.step:
            self._end_run_mid_epoch({"train/samples": 0})

    def _epoch_finished(self) -> bool:
        return self.loader.at_last_batch

    def _end_epoch(self, metrics: Dict[str, float]) -> None:
        self.loader.end_pass()  # max_steps may have left the loop on the epoch's last batch
        self.state.epoch += 1
        every = self.cfg.eval_every
        last = self.state.epoch == self.cfg.epochs or self._stop()  # the run ends here
        if (every and self.state.epoch % every == 0) or last:
            metrics.update(self.evaluate())
        if self.cfg.scheduler is not None and self.cfg.scheduler_interval == "epoch":
            self.cfg.scheduler.step()
        metrics["epoch"] = self.state.epoch
        self._report(metrics)
        for hook in self.cfg.hooks:
            hook.on_epoch_end(self, metrics)
        if self.ckpt is not None and self.ckpt.every_epoch:
            self.save()

    def _end_run_mid_epoch(self, metrics: Dict[str, float]) -> None:
        """``max_steps`` ended the run inside an epoch: it still ends like any other run, with
        the final evaluation, its line and its history entry (the epoch stays unfinished, so
        a resume with more steps continues it)."""
        metrics.update(self.evaluate())
        metrics["epoch"] = self.state.epoch + 1
        metrics["stopped_at_step"] = self.state.step
        self._report(metrics, f"  (max_steps reached at step {self.state.step}; epoch "
                              f"{metrics['epoch']} not finished)")

    def _report(self, metrics: Dict[str, float], note: str = "") -> None:
        """The end of an epoch (or of the run): best so far, history, the epoch's line, log."""
        self._track_best(metrics)
        self.state.history.append(metrics)
        steps, skipped = self._epoch_steps
        if skipped:
            note += f"  skipped {skipped}/{steps} steps (NaN/inf gradients)"
        comm.print0(format_epoch(metrics, self.cfg.epochs) + note)
        if skipped and skipped == steps:
            comm.print0(f"warning: every step of epoch {metrics['epoch']} had NaN/inf gradients "
                        "and was skipped: the model did not change; lower --lr or set "
                        "--clip-grad", file=sys.stderr)
        if self.logger is not None:
            self.logger.log(metrics, self.state.step)

    def _track_best(self, metrics: Dict[str, float]) -> None:
        value = metrics.get(f"eval/{self.cfg.monitor}")
        if value is not None and (self.state.best is None or value > self.state.best):
            self.state.best, self.state.best_epoch = value, metrics["epoch"]
            metrics["best"] = value
            if self.checkpoints is not None:
                self.checkpoints.extra["best"] = {"best": value, "best_epoch": metrics["epoch"]}


def fit(rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer,
        loader: DistributedLoader, config: Optional[FitConfig] = None,
        **options: Any) -> TrainState:
    """Train ``model`` on every rank as ``config`` says; returns the :class:`TrainState`.

    ``options`` are :class:`FitConfig` fields, given instead of (or over) ``config``. The
    loader's epochs are set by the loop (resume-aware); evaluation is exact; with a
    ``checkpoint`` policy the run can be killed and resumed bit-exactly.

    Example::

        rt = ddpkit.setup(seed=0)
        model = rt.wrap(Net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = fit(rt, model, opt, rt.loader(train_set, 256),
                    FitConfig(epochs=5, eval_data=test_set, accum_steps=2))
        state = fit(rt, model, opt, rt.loader(train_set, 256), epochs=5)   # the same, inline
    """
    if isinstance(config, Mapping):  # before FitConfig, `config` was the dict stored in checkpoints
        options["config"], config = dict(config), None
    if config is None:
        config = FitConfig(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    return _Fit(rt, model, optimizer, loader, config).run()


class _EpochSums:
    """The running epoch's loss and sample sums over every rank, carried by a mid-epoch
    checkpoint, so that the epoch a run resumes into reports all of it (its loss and sample
    count), not only the steps after the resume. Saving sums them over the ranks (every rank
    saves together); on resume rank 0 starts from them."""

    def __init__(self, loop: "_Fit") -> None:
        self.loop = loop

    def state_dict(self) -> Optional[Dict[str, Any]]:
        loop = self.loop
        totals = comm.reduce(loop._epoch_sums[:3].clone(), "sum")  # a collective, on every rank
        if loop.checkpoints is None or not loop.checkpoints.mid_epoch:
            return None  # at an epoch's end the next one starts from nothing
        return {"epoch": loop.state.epoch, "sums": [float(x) for x in totals.tolist()]}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        self.loop._carried = state

