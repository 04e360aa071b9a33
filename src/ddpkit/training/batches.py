"""What a batch and a model's output may be, for :func:`ddpkit.fit` and :func:`ddpkit.evaluate`.

Batches are tensors, tuples/lists ``(inputs, targets, ...)`` or dicts (Hugging Face style,
``model(**batch)``), moved to the device as they are. Outputs are logits tensors or objects with
``.logits`` / ``.loss``. Losses and metrics are sums and counts over *targets* (tokens for a
language model, samples for a classifier), so a mean over any number of ranks is exact;
``ignore_index`` targets (padding) count nowhere.

Example::

    batch = to_device({"input_ids": ids, "labels": ids}, rt.device)
    out = forward(model, batch)
    total, count = loss_sum(logits_of(out), targets_of(batch))
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import ConfigError

__all__ = ["to_device", "channels_last", "batch_size_of", "forward", "logits_of", "targets_of",
           "cross_entropy", "is_regression", "regression_pair", "default_loss", "loss_sum",
           "topk_hits", "step_sums", "step_outputs", "sum_count", "IGNORE_INDEX", "STEP_OUTPUTS",
           "aligned"]

#: Targets equal to this are padding: no loss, no count (PyTorch's and Hugging Face's default).
IGNORE_INDEX = -100

#: Keys a ``step`` may add beside its sums: the batch's outputs and targets, for ``metrics=``.
STEP_OUTPUTS = ("outputs", "targets")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (tensors, tuples, lists, dicts, nested).

    Example::

        x, y = to_device((x, y), rt.device)
    """
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):  # a BatchEncoding becomes a plain dict: model(**batch) works
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return moved if isinstance(batch, list) else tuple(moved)
    return batch


def channels_last(batch: Any) -> Any:
    """``batch`` with its 4-D image inputs (the first element of a tuple/list) in channels_last
    memory format; anything else as it is.

    Example::

        x, y = channels_last((x, y))
    """
    if isinstance(batch, (list, tuple)) and batch and torch.is_tensor(batch[0]) and \
            batch[0].dim() == 4:
        return [batch[0].contiguous(memory_format=torch.channels_last), *batch[1:]]
    return batch


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor.

    Example::

        batch_size_of({"input_ids": torch.zeros(8, 128)})   # 8
    """
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if torch.is_tensor(value) and value.dim():
            return int(value.shape[0])
    raise ConfigError(f"cannot tell the batch size of a {type(batch).__name__}: a batch must "
                      "hold tensors (a tensor, a tuple/list of them, or a dict)")


def forward(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on ``batch`` the way its structure says: ``model(**batch)`` for a dict,
    ``model(batch[0])`` for a tuple/list ``(inputs, targets, ...)``, ``model(batch)`` for a tensor.

    Example::

        out = forward(model, {"input_ids": ids, "labels": ids})   # model(input_ids=..., labels=...)
    """
    try:
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, (list, tuple)):
            return model(batch[0])
        return model(batch)
    except TypeError as exc:
        if "argument" not in str(exc):
            raise
        kind = (f"a dict with keys {sorted(batch)}" if isinstance(batch, Mapping)
                else f"a {type(batch).__name__}")
        raise ConfigError(f"the model cannot take the batch ({kind}): {exc}; give batches as "
                          "(inputs, targets) tuples, dicts of the model's keyword arguments, or "
                          "pass step=fn(model, batch)") from None


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, ``.logits`` or ``["logits"]``.

    Example::

        logits_of(hf_model(input_ids=ids))   # its .logits
    """
    if torch.is_tensor(output):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if logits is None and isinstance(output, (list, tuple)) and output and \
            torch.is_tensor(output[0]):
        logits = output[0]
    if not torch.is_tensor(logits):
        raise ConfigError(f"the model returned a {type(output).__name__} without logits; return "
                          "a tensor or an object with .logits, or pass step=fn(model, batch)")
    return logits


def targets_of(batch: Any) -> torch.Tensor:
    """The targets of a batch: its second element, or ``["labels"]`` of a dict.

    Example::

        targets_of((x, y))   # y
    """
    if isinstance(batch, Mapping):
        if torch.is_tensor(batch.get("labels")):
            return batch["labels"]
        raise ConfigError(f"a dict batch needs a 'labels' tensor to be scored (keys: "
                          f"{sorted(batch)}); or pass step=fn(model, batch)")
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and torch.is_tensor(batch[1]):
        return batch[1]
    raise ConfigError("a batch needs targets to be scored: (inputs, targets) or a dict with "
                      "'labels'; or pass step=fn(model, batch)")


def aligned(logits: torch.Tensor, targets: torch.Tensor,
            shift: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Logits as ``(M, C)`` and targets as ``(M,)`` over every target position; ``shift`` drops
    the last position's logits and the first target (a causal LM's labels are its inputs).

    A clear error when the shapes do not pair up.

    Example::

        flat_logits, flat_targets = aligned(logits, y)   # (B, T, V), (B, T) -> (B*T, V), (B*T,)
    """
    if shift:
        logits, targets = logits[:, :-1], targets[:, 1:]
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ConfigError(f"logits of shape {tuple(logits.shape)} do not match targets of shape "
                          f"{tuple(targets.shape)}: expected logits (*, classes) for targets (*)")
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                  ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy over every target position of any shape (classes last); the default
    training loss of :func:`ddpkit.fit`.

    Example::

        loss = cross_entropy(model(x), y)   # (B, C) and (B,), or (B, T, V) and (B, T)
    """
    flat_logits, flat_targets = aligned(logits, targets)
    return F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index)


def is_regression(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Are these a regression's outputs and targets? Yes when the targets are floating point and
    both shapes agree once a trailing 1 is dropped: ``(B,)`` or ``(B, 1)`` outputs against
    ``(B,)`` targets, ``(B, k)`` against ``(B, k)``. Integer targets with ``(*, classes)``
    logits are a classification. (A single-logit binary classifier with float 0/1 targets
    counts as a regression too: give it its ``loss_fn``.)

    Example::

        is_regression(torch.randn(8, 1), torch.randn(8))              # True
        is_regression(torch.randn(8, 3), torch.randint(0, 3, (8,)))   # False
    """
    return targets.is_floating_point() and _squeezed(outputs.shape) == _squeezed(targets.shape)


def _squeezed(shape: torch.Size) -> Tuple[int, ...]:
    return tuple(shape[:-1]) if len(shape) and shape[-1] == 1 else tuple(shape)


def regression_pair(outputs: torch.Tensor,
                    targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A regression's outputs shaped like its targets, both in the outputs' precision (at least
    float32): ``(B, 1)`` against ``(B,)`` would otherwise broadcast to ``(B, B)`` in
    ``F.mse_loss``, with only a warning.

    Example::

        pred, y = regression_pair(model(x), y)   # (B, 1), (B,) float64 -> (B,), (B,) float32
    """
    dtype = torch.promote_types(outputs.dtype, torch.float32)
    return outputs.reshape(targets.shape).to(dtype), targets.to(dtype)


def default_loss(outputs: torch.Tensor, targets: torch.Tensor,
                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The loss when none is given: mean squared error for a regression (see
    :func:`is_regression`), else :func:`cross_entropy` over logits of any shape.

    Example::

        loss = default_loss(model(x), y)   # float y (B,), outputs (B, 1): MSE; int y: cross-entropy
    """
    if is_regression(outputs, targets):
        return F.mse_loss(*regression_pair(outputs, targets))
    return cross_entropy(outputs, targets, ignore_index)


def _takes_reduction(fn: Callable[..., Any]) -> bool:
    try:
        return "reduction" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def loss_sum(logits: torch.Tensor, targets: torch.Tensor,
             loss_fn: Optional[Callable[..., torch.Tensor]] = None,
             ignore_index: int = IGNORE_INDEX, shift: bool = False
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum of the loss, number of targets that count) for one batch, both on the device.

    Without ``loss_fn``: cross-entropy summed over the positions whose target is not
    ``ignore_index``, or for a regression (:func:`is_regression`) squared errors summed over
    every target value. A ``loss_fn`` that takes ``reduction=`` (like ``F.cross_entropy``) is
    asked for the sum; any other (a lambda, ``nn.CrossEntropyLoss()``) is taken as a mean over
    the counted targets.

    Example::

        total, count = loss_sum(logits, y)
    """
    if is_regression(logits, targets):
        pred, y = regression_pair(logits, targets)
        count = torch.tensor(y.numel(), device=y.device)
        if loss_fn is None:  # squared errors summed in float64: the same at any batch split
            return (pred.double() - y.double()).square().sum(), count
        return _summed(loss_fn, pred, y, count), count
    flat_logits, flat_targets = aligned(logits, targets, shift)
    count = (flat_targets != ignore_index).sum()
    if loss_fn is None:  # per-target losses summed in float64: the same at any batch split
        total = F.cross_entropy(flat_logits.float(), flat_targets, ignore_index=ignore_index,
                                reduction="none").double().sum()
        return total, count
    return _summed(loss_fn, flat_logits.float(), flat_targets, count), count


def _summed(loss_fn: Callable[..., torch.Tensor], outputs: torch.Tensor, targets: torch.Tensor,
            count: torch.Tensor) -> torch.Tensor:
    if _takes_reduction(loss_fn):
        return loss_fn(outputs, targets, reduction="sum").double()
    return (loss_fn(outputs, targets) * count).double()


def topk_hits(logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int],
              ignore_index: int = IGNORE_INDEX, shift: bool = False) -> torch.Tensor:
    """For each k, the counted targets among the top-k logits (a float64 device tensor).

    Example::

        top1, top5 = topk_hits(logits, y, (1, 5)).tolist()
    """
    flat_logits, flat_targets = aligned(logits, targets, shift)
    kmax = min(max(ks), flat_logits.shape[-1])
    hit = flat_logits.topk(kmax, dim=-1).indices.eq(flat_targets.view(-1, 1))
    valid = flat_targets != ignore_index
    return torch.stack([(hit[:, :min(k, kmax)].any(dim=1) & valid).sum() for k in ks]).double()


def step_sums(result: Any) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Check what a user ``step(model, batch)`` returned: ``{name: (sum, count)}``, and perhaps
    the batch's ``"outputs"`` and ``"targets"`` (:data:`STEP_OUTPUTS`, left out here) for
    ``metrics=``.

    Example::

        step_sums({"loss": (loss_sum, tokens), "acc": (hits, tokens)})
    """
    bad = ConfigError(f"step must return a dict of name -> (sum, count), for example "
                      f"{{'loss': (loss_sum, tokens)}}; got {_describe(result)}")
    if not isinstance(result, Mapping):
        raise bad
    out: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for name, value in result.items():
        if name in STEP_OUTPUTS:
            continue
        pair = _pair(value)
        if pair is None:
            raise bad
        out[str(name)] = pair
    if not out:
        raise bad
    return out


def step_outputs(result: Mapping[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``"outputs"`` and ``"targets"`` tensors a step returned beside its sums, which feed
    ``metrics=``; a one-line error when they are missing.

    Example::

        outputs, targets = step_outputs({"loss": (total, n), "outputs": logits, "targets": y})
    """
    outputs, targets = result.get("outputs"), result.get("targets")
    if torch.is_tensor(outputs) and torch.is_tensor(targets):
        return outputs, targets
    raise ConfigError(f"metrics= with step=: the step must also return the batch's 'outputs' "
                      f"and 'targets' tensors for the metrics, for example {{'loss': (total, n), "
                      f"'outputs': logits, 'targets': y}}; got {_describe(result)}")


def sum_count(value: Any, what: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``value`` as a (sum, count) pair of scalar tensors, or a one-line error naming ``what``.

    Example::

        total, count = sum_count(metric_fn(outputs, y), "metrics['mape']")
    """
    pair = _pair(value)
    if pair is None:
        raise ConfigError(f"{what} must return (sum, count), for example "
                          f"((pred - y).abs().sum(), y.numel()); got {_describe(value)}")
    return pair


def _pair(value: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return None
    total, count = (torch.as_tensor(v) for v in value)
    if total.numel() != 1 or count.numel() != 1:
        return None
    return total.reshape(()), count.reshape(())


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in value.items()) + "}"
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
