"""Exact distributed evaluation: every sample counted once, metrics reduced as (sum, count).

``DistributedSampler`` pads the last shard with duplicates (PyTorch issue 25162); here each rank
evaluates a disjoint block and only sums and counts cross the wire, once, at the end.
"""
from __future__ import annotations

import contextlib
import math
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, Union)

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from ..engines import comm
from ..data.loader import ShardSampler
from .batches import IGNORE_INDEX
from .batches import channels_last as to_channels_last
from .batches import forward, is_regression, logits_of, loss_sum, regression_pair, step_outputs, step_sums, sum_count, targets_of, to_device, topk_hits
from ..base.errors import ConfigError
from ..faults import stall
from .precision import Precision
from ..data.resident import choose_resident, resident_batches
from ..base.seed import preserved_rng
from ..checkpoint.sharded import is_sharded
from ..base.wrap import unwrap

__all__ = ["evaluate", "topk_correct", "rank0_buffers", "perplexity"]

Pair = Tuple[torch.Tensor, torch.Tensor]
#: A regression's (sum, count) names: the errors, then the sums of y and y^2 that make r2 exact.
REGRESSION_SUMS = ("mse", "mae", "_sum_y", "_sum_y2")


def perplexity(loss: float) -> float:
    """A language model's perplexity from its mean token loss (capped where ``exp`` would
    overflow: a diverged model's loss).

    Example::

        perplexity(2.0)   # 7.389...
    """
    return math.exp(min(loss, 700.0))


def topk_correct(logits: torch.Tensor, target: torch.Tensor, ks: Sequence[int]) -> list[int]:
    """Number of targets among the top-k logits, for each k (any shape ``(*, classes)``).

    Example::

        top1, top5 = topk_correct(logits, y, (1, 5))
    """
    return [int(v) for v in topk_hits(logits, target, ks).tolist()]


def _eval_batches(data: Any, batch_size: int, num_workers: int, device: torch.device,
                  resident: Any, collate_fn: Optional[Callable] = None) -> Iterable[Any]:
    if isinstance(data, DataLoader):
        return data  # the caller promises it already shards without padding
    sampler = ShardSampler(len(data), comm.world_size(), comm.rank())
    on_device = choose_resident(data, device, resident) if collate_fn is None else None
    if on_device is not None:  # this rank's block gathered on the device, batch by batch
        return resident_batches(on_device, list(sampler), batch_size, False, 0, 0)
    # A generator of its own: iterating a DataLoader draws its workers' base seed, and from
    # the global RNG that would shift the training's later draws (dropout, augmentation) by
    # whether, and on which ranks, an evaluation ran.
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        collate_fn=collate_fn, generator=torch.Generator().manual_seed(0))
    loader._ddpkit_owned = True  # type: ignore[attr-defined]
    return loader


_EVAL_BATCH = 256  #: evaluate's per_rank_batch unless told


def _per_rank(per_rank_batch: int, batch_size: Optional[int]) -> int:
    """evaluate's batch, a rank's: ``per_rank_batch=``, or ``batch_size=``, its older name."""
    if batch_size is not None:
        if per_rank_batch not in (_EVAL_BATCH, batch_size):
            raise ConfigError(f"evaluate: per_rank_batch={per_rank_batch} and batch_size="
                              f"{batch_size} name the same number (a rank's batch); give one")
        per_rank_batch = batch_size
    if not isinstance(per_rank_batch, int) or per_rank_batch < 1:
        raise ConfigError(f"evaluate: per_rank_batch must be >= 1, got {per_rank_batch!r}")
    return per_rank_batch


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, *, per_rank_batch: int = _EVAL_BATCH,
             batch_size: Optional[int] = None,
             loss_fn: Optional[Callable[..., torch.Tensor]] = None,
             topk: Sequence[int] = (1, 5), device: Optional[torch.device] = None,
             precision: Optional[Precision] = None, metrics: Optional[Mapping[str, Any]] = None,
             num_workers: int = 0, channels_last: bool = False,
             resident: Union[str, bool] = "auto",
             step: Optional[Callable[[nn.Module, Any], Mapping[str, Any]]] = None,
             ignore_index: int = IGNORE_INDEX, shift_labels: Optional[bool] = None,
             collate_fn: Optional[Callable] = None) -> Dict[str, float]:
    """Evaluate on every rank's disjoint share of ``data``; all ranks get the exact global result.

    Batches may be ``(inputs, targets)``, dicts (``model(**batch)``, targets in ``"labels"``) or
    tensors; the model may return logits of any shape ``(*, classes)`` or an object with
    ``.logits`` (Hugging Face). Returns ``count`` (targets counted: samples for a classifier,
    tokens for a language model; ``ignore_index`` targets are not counted), ``loss`` (mean over
    them) and ``top{k}`` accuracies in percent for each k in ``topk`` (``topk=()``: none).

    A regression (float targets shaped like the outputs, ``(B, 1)`` against ``(B,)`` included;
    see :func:`ddpkit.training.batches.is_regression`) returns ``loss`` (MSE unless ``loss_fn``), ``mse``,
    ``mae``, ``r2`` and ``count`` (target values) instead of ``top{k}``; r2 is ``1 - SSE / SST``
    over every target value, from float64 sums over all ranks (NaN when the targets are
    constant).

    ``metrics`` maps names to torchmetrics ``Metric`` objects (they sync across ranks
    themselves) or to functions ``fn(outputs, targets) -> (sum, count)``, reduced exactly like
    the loss; a regression's outputs reach them shaped like the targets.

    ``loss_fn`` is optional; one taking ``reduction=`` is asked for sums, any other is taken as
    a mean. ``step(model, batch) -> {name: (sum, count)}`` replaces all of that: the result
    holds ``name: sum / count`` for each name, and ``count`` (of ``loss``, or the first); with
    ``metrics``, the step also returns ``"outputs"`` and ``"targets"`` tensors for them.
    ``shift_labels`` scores logits at t against targets at t+1; ``None`` decides for dict batches
    whose model returns ``.loss`` (a Hugging Face causal LM shifts internally) by which
    alignment reproduces that loss on the first batch.

    One model is scored: every rank evaluates with rank 0's buffers (BatchNorm running
    statistics and anything else ``model.buffers()`` holds: what a checkpoint saves, since rank
    0 writes it), so the result equals the saved checkpoint's at any world size. Training
    updates each rank's statistics on its own batches, and DDP copies rank 0's over them only
    at the next training forward (not at all with ``broadcast_buffers=False``, FSDP or
    Horovod), so without this each rank would score its share with a different model. Each
    rank's own buffers are put back afterwards: the training goes on exactly as without the
    evaluation.

    ``per_rank_batch`` is each rank's batch (``batch_size=`` is its older name, the same number;
    given both, they must agree): the result is exact whatever it is, so it sets only memory and speed, per
    device, as an evaluation batch does in Lightning or Accelerate. Runs the unwrapped module, so DDP never waits on a collective
    while ranks process different numbers of batches. Sums stay on the device until the end
    (no sync per batch); ``resident`` is as in :func:`ddpkit.data.loader.make_loader` (on a GPU, data
    that fits is evaluated from device memory). The RNG streams (Python, NumPy, torch) are left
    where they were, so evaluating mid-training does not change the batches that follow.

    Example::

        result = evaluate(model, test_set, per_rank_batch=128)
        print0(f"top-1 {result['top1']:.2f}% on {result['count']} samples")
        lm = evaluate(gpt, val_tokens, topk=())          # (B, T, V) logits: per-token loss
        print0(f"perplexity {perplexity(lm['loss']):.2f} over {lm['count']} tokens")
        reg = evaluate(regressor, val_rows)             # (B, 1) outputs, float (B,) targets
        print0(f"r2 {reg['r2']:.4f}, mae {reg['mae']:.3f}")
    """
    batch = _per_rank(per_rank_batch, batch_size)
    net = unwrap(model)
    device = device or next(net.parameters()).device
    scorer = _Scorer(loss_fn, tuple(topk), ignore_index, shift_labels, step,
                     _checked(metrics, topk))
    was_training = net.training
    # The loader's base seed and a dataset's random augmentation draw from the global streams:
    # without this, evaluating mid-training would change the training batches after it.
    with preserved_rng(), rank0_buffers(net), stall.phase("evaluation"):
        net.eval()
        try:
            batches = _eval_batches(data, batch, num_workers, device, resident, collate_fn)
            # FSDP gathers parameters collectively: every rank runs as many forwards (fillers
            # uncounted)
            paired = _lockstep(batches, data, collate_fn) if is_sharded(net) else \
                ((b, True) for b in batches)
            sums = _tally(net, paired, scorer, device, precision or Precision("fp32", device),
                          channels_last)
        finally:
            net.train(was_training)
        return scorer.finish(sums)


@contextlib.contextmanager
def rank0_buffers(model: nn.Module) -> Iterator[None]:
    """Inside the block every rank holds rank 0's buffers (``model.buffers()``: BatchNorm's
    running mean, variance and ``num_batches_tracked``, ...); after it, its own again. A
    collective: every rank enters it. Nothing to do with one process or no buffers.

    Run the unwrapped module inside, as :func:`evaluate` does: a forward through DDP's wrapper
    in the block would make DDP skip its buffer broadcast at the next training forward, and the
    ranks would train on from their own statistics.

    Example::

        net = rt.unwrap(model)
        with rank0_buffers(net):                # score the model the checkpoint holds
            val_loss = my_own_evaluation(net)
    """
    buffers = list(model.buffers())
    if comm.world_size() == 1 or not buffers:
        yield
        return
    own = [b.detach().clone() for b in buffers]
    # Sent as CPU tensors through the engine's object broadcast, which every engine has
    # (Horovod's too); buffers are small next to the parameters, and this runs once per
    # evaluation, not per step.
    sent = comm.broadcast_object([b.detach().cpu() for b in buffers] if comm.is_main() else None)
    try:
        with torch.no_grad():
            for buffer, theirs in zip(buffers, sent):
                buffer.copy_(theirs)
        yield
    finally:
        with torch.no_grad():
            for buffer, mine in zip(buffers, own):
                buffer.copy_(mine)


def _tally(net: nn.Module, paired: Iterable[Tuple[Any, bool]], scorer: "_Scorer",
           device: torch.device, prec: Precision, channels_last: bool) -> Dict[str, torch.Tensor]:
    """name -> [sum, count] float64 on the device, summed over this rank's batches."""
    sums: Dict[str, torch.Tensor] = {}
    for batch, counted in paired:
        batch = to_device(batch, device)
        if channels_last:
            batch = to_channels_last(batch)
        with prec.autocast():
            out = scorer.step(net, batch) if scorer.step is not None else forward(net, batch)
        if not counted:
            continue
        for name, (total, count) in scorer(out, batch).items():
            pair = torch.stack([total.to(device, torch.float64), count.to(device, torch.float64)])
            sums[name] = sums[name] + pair if name in sums else pair
    return sums


def _is_metric_object(metric: Any) -> bool:
    return hasattr(metric, "update") and hasattr(metric, "compute")  # torchmetrics-like


def _checked(metrics: Optional[Mapping[str, Any]], ks: Sequence[int]) -> Dict[str, Any]:
    results = ["loss", "count", "mse", "mae", "r2", *(f"top{k}" for k in ks)]
    for name, metric in (metrics or {}).items():
        if name in results or name in REGRESSION_SUMS:
            raise ConfigError(f"metrics: the name {name!r} is one of evaluate's own results "
                              f"({', '.join(results)}); choose another")
        if not (_is_metric_object(metric) or callable(metric)):
            raise ConfigError(f"metrics[{name!r}] must be a torchmetrics Metric or a function "
                              f"fn(outputs, targets) -> (sum, count); got an object of type "
                              f"{type(metric).__name__}")
    return dict(metrics or {})


class _Scorer:
    """One batch's output -> (sum, count) pairs, and the reduced pairs -> the results. Whether
    the task is a regression, and whether a causal LM's labels are shifted, is decided on the
    first batch."""

    def __init__(self, loss_fn: Optional[Callable[..., torch.Tensor]], ks: Tuple[int, ...],
                 ignore_index: int, shift: Optional[bool], step: Optional[Callable[..., Any]],
                 metrics: Dict[str, Any]):
        self.loss_fn, self.ks, self.ignore_index, self.shift = loss_fn, ks, ignore_index, shift
        self.step, self.metrics = step, metrics
        self.fns = [name for name, m in metrics.items() if not _is_metric_object(m)]
        self.regression: Optional[bool] = None

    def __call__(self, out: Any, batch: Any) -> Dict[str, Pair]:
        if self.step is not None:
            pairs = step_sums(out)
            if not self.metrics:
                return pairs
            outputs, targets = step_outputs(out)
        else:
            outputs, targets = logits_of(out), targets_of(batch)
            if self.regression is None:
                self.regression = is_regression(outputs, targets)
            if self.regression:
                outputs, targets = regression_pair(outputs, targets)
                pairs = _regression_sums(outputs, targets, self.loss_fn)
            else:
                outputs = outputs.float()
                pairs = self._classification_sums(out, outputs, targets)
        return {**pairs, **self._metric_sums(outputs, targets, pairs)}

    def _classification_sums(self, out: Any, logits: torch.Tensor,
                             targets: torch.Tensor) -> Dict[str, Pair]:
        if self.shift is None:
            self.shift = _shifted(out, logits, targets, self.ignore_index)
        total, count = loss_sum(logits, targets, self.loss_fn, self.ignore_index, self.shift)
        pairs = {"loss": (total, count)}
        if self.ks:
            hits = topk_hits(logits, targets, self.ks, self.ignore_index, self.shift)
            pairs.update({f"top{k}": (hits[i] * 100.0, count) for i, k in enumerate(self.ks)})
        return pairs

    def _metric_sums(self, outputs: torch.Tensor, targets: torch.Tensor,
                     taken: Mapping[str, Pair]) -> Dict[str, Pair]:
        pairs: Dict[str, Pair] = {}
        for name, metric in self.metrics.items():
            if _is_metric_object(metric):
                metric.update(outputs, targets)
                continue
            if name in taken:
                raise ConfigError(f"metrics: the step returns {name!r} already; rename one")
            pairs[name] = sum_count(metric(outputs, targets), f"metrics[{name!r}]")
        return pairs

    def finish(self, sums: Dict[str, torch.Tensor]) -> Dict[str, float]:
        totals = _reduce(self._names(sums), sums)
        regression = self.step is None and totals["mse"][1] > 0
        if self.step is not None:
            shown = [n for n in totals if n not in self.fns]
        elif regression:
            shown = ["loss", "mse", "mae"]
        else:
            shown = ["loss", *(f"top{k}" for k in self.ks)]
        out = {name: _mean(*totals[name]) for name in [*shown, *self.fns]}
        if regression:
            out["r2"] = _r2(totals)
        first = "loss" if "loss" in shown else (shown[0] if shown else None)
        out["count"] = int(totals[first][1]) if first is not None else 0
        if out["count"] == 0:
            raise ConfigError("evaluate: no targets were counted (the evaluation data is empty, "
                              "or every target equals ignore_index); check the data you pass")
        out.update(_computed(self.metrics))
        return out

    def _names(self, sums: Mapping[str, torch.Tensor]) -> List[str]:
        """The names every rank reduces, in the same order (a rank with an empty shard too)."""
        if self.step is not None:  # the step's names, from every rank (a shard may be empty)
            return sorted(set(self.fns).union(*comm.gather_object(sorted(sums))))
        return ["loss", *(f"top{k}" for k in self.ks), *REGRESSION_SUMS, *self.fns]


def _regression_sums(pred: torch.Tensor, y: torch.Tensor,
                     loss_fn: Optional[Callable[..., torch.Tensor]]) -> Dict[str, Pair]:
    """A regression batch's pairs, summed in float64 so they add up the same at any split."""
    loss = loss_sum(pred, y, loss_fn)
    err, y64 = pred.double() - y.double(), y.double()
    n = loss[1]
    return {"loss": loss, "mse": (err.square().sum(), n), "mae": (err.abs().sum(), n),
            "_sum_y": (y64.sum(), n), "_sum_y2": (y64.square().sum(), n)}


def _reduce(names: List[str], sums: Mapping[str, torch.Tensor]) -> Dict[str, Tuple[float, float]]:
    zero = torch.zeros(2, dtype=torch.float64)
    local = torch.stack([sums.get(n, zero).cpu() for n in names]) if names else \
        torch.zeros(0, 2, dtype=torch.float64)
    totals = comm.reduce(local, "sum")
    return {name: (total, count) for name, (total, count) in zip(names, totals.tolist())}


def _mean(total: float, count: float) -> float:
    return total / count if count else float("nan")


def _r2(totals: Mapping[str, Tuple[float, float]]) -> float:
    """1 - SSE / SST, with SST = sum(y^2) - sum(y)^2 / n over every rank's targets."""
    sse, n = totals["mse"]
    sst = totals["_sum_y2"][0] - totals["_sum_y"][0] ** 2 / n
    return 1.0 - sse / sst if sst > 0 else float("nan")


def _computed(metrics: Mapping[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, metric in metrics.items():
        if _is_metric_object(metric):
            value = metric.compute()
            out[name] = float(value) if torch.is_tensor(value) and value.numel() == 1 else value
            metric.reset()
    return out


def _lockstep(batches: Any, data: Any, collate_fn: Optional[Callable]) -> Iterable[Any]:
    """``(batch, counted)`` pairs, as many on every rank: ranks with fewer batches repeat a
    filler batch whose results are dropped."""
    mine = list(batches)
    most = int(comm.reduce(len(mine), "max"))
    filler = mine[-1] if mine else (collate_fn or default_collate)([data[0]])
    return [(b, True) for b in mine] + [(filler, False)] * (most - len(mine))


def _shifted(out: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> bool:
    """Does the model's own ``.loss`` score logits at t against targets at t+1?"""
    model_loss = getattr(out, "loss", None)
    if not torch.is_tensor(model_loss) or logits.dim() < 3 or logits.shape[:-1] != targets.shape:
        return False
    plain, n_plain = loss_sum(logits, targets, None, ignore_index, False)
    moved, n_moved = loss_sum(logits, targets, None, ignore_index, True)
    off_plain = abs(float(plain / n_plain.clamp(min=1)) - float(model_loss))
    off_moved = abs(float(moved / n_moved.clamp(min=1)) - float(model_loss))
    return off_moved < off_plain
