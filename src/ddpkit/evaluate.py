"""Exact distributed evaluation: every sample counted once, metrics reduced as (sum, count).

``DistributedSampler`` pads the last shard with duplicates (PyTorch issue 25162); here each rank
evaluates a disjoint block and only sums and counts cross the wire, once, at the end.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import comm
from .data import ShardSampler
from .precision import Precision
from .resident import choose_resident, resident_batches
from .wrap import unwrap

__all__ = ["evaluate", "topk_correct"]


def topk_correct(logits: torch.Tensor, target: torch.Tensor, ks: Sequence[int]) -> list[int]:
    """Number of samples whose target is among the top-k logits, for each k.

    Example::

        top1, top5 = topk_correct(logits, y, (1, 5))
    """
    return [int(v) for v in _topk_hits(logits, target, ks).tolist()]


def _eval_batches(data: Any, batch_size: int, num_workers: int, device: torch.device,
                  resident: Any) -> Iterable[Any]:
    if isinstance(data, DataLoader):
        return data  # the caller promises it already shards without padding
    sampler = ShardSampler(len(data), comm.world_size(), comm.rank())
    on_device = choose_resident(data, device, resident)
    if on_device is not None:  # this rank's block gathered on the device, batch by batch
        return resident_batches(on_device, list(sampler), batch_size, False, 0, 0)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 256,
             loss_fn: Optional[Callable[..., torch.Tensor]] = None, topk: Sequence[int] = (1, 5),
             device: Optional[torch.device] = None, precision: Optional[Precision] = None,
             metrics: Optional[Mapping[str, Any]] = None, num_workers: int = 0,
             channels_last: bool = False, resident: Union[str, bool] = "auto") -> Dict[str, float]:
    """Evaluate on every rank's disjoint share of ``data``; all ranks get the exact global result.

    Returns ``count``, ``loss`` (mean over all samples) and ``top{k}`` accuracies in percent, plus
    the value of each torchmetrics ``Metric`` in ``metrics`` (they sync across ranks themselves).
    ``batch_size`` is per rank. Runs the unwrapped module, so DDP never waits on a collective
    while ranks process different numbers of batches. Sums stay on the device until the end
    (no sync per batch); ``resident`` is as in :func:`ddpkit.data.make_loader` (on a GPU, data
    that fits is evaluated from device memory).

    Example::

        result = evaluate(model, test_set, batch_size=128, loss_fn=nn.functional.cross_entropy)
        print0(f"top-1 {result['top1']:.2f}% on {result['count']} samples")
    """
    net = unwrap(model)
    was_training = net.training
    net.eval()
    device = device or next(net.parameters()).device
    loss_fn = loss_fn or nn.functional.cross_entropy
    prec = precision or Precision("fp32", device)
    # loss sum, count, top-k hits: on the device, read once at the end
    totals = torch.zeros(2 + len(topk), dtype=torch.float64, device=device)
    for x, y in _eval_batches(data, batch_size, num_workers, device, resident):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with prec.autocast():
            logits = net(x)
        logits = logits.float()
        totals[0] += loss_fn(logits, y, reduction="sum").double()
        totals[1] += y.shape[0]
        if topk:
            totals[2:] += _topk_hits(logits, y, topk)
        for metric in (metrics or {}).values():
            metric.update(logits, y)
    net.train(was_training)
    return _finish(comm.reduce(totals.cpu(), "sum"), topk, metrics)


def _topk_hits(logits: torch.Tensor, target: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    kmax = min(max(ks), logits.shape[-1])
    hit = logits.topk(kmax, dim=-1).indices.eq(target.view(-1, 1))
    return torch.stack([hit[:, :min(k, kmax)].any(dim=1).sum() for k in ks]).double()


def _finish(totals: torch.Tensor, topk: Sequence[int],
            metrics: Optional[Mapping[str, Any]]) -> Dict[str, float]:
    count = int(totals[1])
    out: Dict[str, float] = {"count": count, "loss": float(totals[0]) / max(count, 1)}
    for k, hits in zip(topk, totals[2:].tolist()):
        out[f"top{k}"] = 100.0 * hits / max(count, 1)
    for name, metric in (metrics or {}).items():
        value = metric.compute()
        out[name] = float(value) if torch.is_tensor(value) and value.numel() == 1 else value
        metric.reset()
    return out
