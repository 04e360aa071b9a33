"""Exact distributed evaluation: every sample counted once, metrics reduced as (sum, count).

``DistributedSampler`` pads the last shard with duplicates (PyTorch issue 25162); here each rank
evaluates a disjoint block and only sums and counts cross the wire, once, at the end.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from . import comm
from .data import ShardSampler
from .batches import IGNORE_INDEX
from .batches import channels_last as to_channels_last
from .batches import forward, logits_of, loss_sum, step_sums, targets_of, to_device, topk_hits
from .errors import ConfigError
from .precision import Precision
from .resident import choose_resident, resident_batches
from .sharded import is_sharded
from .wrap import unwrap

__all__ = ["evaluate", "topk_correct"]


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
    return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      collate_fn=collate_fn)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 256,
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
    them) and ``top{k}`` accuracies in percent for each k in ``topk`` (``topk=()``: none), plus
    the value of each torchmetrics ``Metric`` in ``metrics`` (they sync across ranks themselves).

    ``loss_fn`` is optional (cross-entropy); one taking ``reduction=`` is asked for sums, any other
    is taken as a mean. ``step(model, batch) -> {name: (sum, count)}`` replaces all of that: the
    result holds ``name: sum / count`` for each name, and ``count`` (of ``loss``, or the first).
    ``shift_labels`` scores logits at t against targets at t+1; ``None`` decides for dict batches
    whose model returns ``.loss`` (a Hugging Face causal LM shifts internally) by which
    alignment reproduces that loss on the first batch.

    ``batch_size`` is per rank. Runs the unwrapped module, so DDP never waits on a collective
    while ranks process different numbers of batches. Sums stay on the device until the end
    (no sync per batch); ``resident`` is as in :func:`ddpkit.data.make_loader` (on a GPU, data
    that fits is evaluated from device memory).

    Example::

        result = evaluate(model, test_set, batch_size=128)
        print0(f"top-1 {result['top1']:.2f}% on {result['count']} samples")
        lm = evaluate(gpt, val_tokens, topk=())          # (B, T, V) logits: per-token loss
        print0(f"perplexity {math.exp(lm['loss']):.2f} over {lm['count']} tokens")
    """
    net = unwrap(model)
    was_training = net.training
    net.eval()
    device = device or next(net.parameters()).device
    prec = precision or Precision("fp32", device)
    sums: Dict[str, torch.Tensor] = {}  # name -> [sum, count] on the device, read once at the end
    ks = tuple(topk)
    shift = shift_labels
    batches = _eval_batches(data, batch_size, num_workers, device, resident, collate_fn)
    # FSDP gathers parameters collectively: every rank runs as many forwards (fillers uncounted)
    paired = _lockstep(batches, data, collate_fn) if is_sharded(net) else \
        ((b, True) for b in batches)
    for batch, counted in paired:
        batch = to_device(batch, device)
        if channels_last:
            batch = to_channels_last(batch)
        with prec.autocast():
            out = step(net, batch) if step is not None else forward(net, batch)
        if not counted:
            continue
        if step is not None:
            pairs = step_sums(out)
        else:
            logits, targets = logits_of(out).float(), targets_of(batch)
            if shift is None:
                shift = _shifted(out, logits, targets, ignore_index)
            total, count = loss_sum(logits, targets, loss_fn, ignore_index, shift)
            pairs = {"loss": (total, count)}
            if ks:
                hits = topk_hits(logits, targets, ks, ignore_index, shift)
                pairs.update({f"top{k}": (hits[i] * 100.0, count) for i, k in enumerate(ks)})
            for metric in (metrics or {}).values():
                metric.update(logits, targets)
        for name, (total, count) in pairs.items():
            pair = torch.stack([total.to(device, torch.float64), count.to(device, torch.float64)])
            sums[name] = sums[name] + pair if name in sums else pair
    net.train(was_training)
    return _finish(sums, step is None, ks, metrics)


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


def _finish(sums: Dict[str, torch.Tensor], scored: bool, ks: Sequence[int],
            metrics: Optional[Mapping[str, Any]]) -> Dict[str, float]:
    # Every rank reduces the same names in the same order (a rank with an empty shard included).
    names = ["loss", *[f"top{k}" for k in ks]]
    if not scored:  # the step's names, from every rank (a rank's shard may be empty)
        names = sorted(set().union(*comm.gather_object(sorted(sums))))
    local = torch.stack([sums.get(n, torch.zeros(2, dtype=torch.float64)).cpu() for n in names]) \
        if names else torch.zeros(0, 2, dtype=torch.float64)
    totals = comm.reduce(local, "sum")
    out: Dict[str, float] = {}
    for name, (total, count) in zip(names, totals.tolist()):
        out[name] = total / count if count else float("nan")
    first = "loss" if "loss" in names else (names[0] if names else None)
    out["count"] = int(totals[names.index(first)][1]) if first is not None else 0
    if out["count"] == 0:
        raise ConfigError("evaluate: no targets were counted (the evaluation data is empty, or "
                          "every target equals ignore_index); check the data you pass")
    for name, metric in (metrics or {}).items():
        value = metric.compute()
        out[name] = float(value) if torch.is_tensor(value) and value.numel() == 1 else value
        metric.reset()
    return out
