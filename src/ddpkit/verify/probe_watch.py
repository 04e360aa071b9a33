"""What ``ddpkit verify``'s probe observes besides the optimizer steps, as evidence for a
diagnosis: a checksum of every sample a forward receives, the model's tensors as a step's first
forward sees them, the script's own collectives with their call sites, the targets each loss
averaged over, and the lines a rank prints. Nothing here runs outside ``ddpkit verify``.
"""
from __future__ import annotations

import os
import sys
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .probe_rng import rng, rng_digest, same  # noqa: F401  (watch.rng() in the probe)

__all__ = ["param_sums", "reverse_batch", "ProbeHook", "rebind", "first_tensor", "row_digests",
           "state_digests", "replica_digests", "call_site", "watch_collectives",
           "watch_losses", "quiet_attention", "PrintTee", "COLLECTIVES", "number", "rng",
           "rng_digest", "same", "autocast_dtype", "norm", "any_rank"]

#: The collectives a script may call itself (DDP's own run in C++ and are not seen here).
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "broadcast", "all_gather_object", "barrier")
_TORCH = os.path.dirname(torch.__file__)
_DDPKIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # ddpkit/
_SMALL = 8  # tensors up to this many elements are recorded by value


def first_tensor(value: Any) -> Optional[torch.Tensor]:
    """The first tensor in a forward's arguments (tuples, lists, dicts of them), or None.

    Example::

        first_tensor(((x, y), {"mask": m}))   # x
    """
    if torch.is_tensor(value):
        return value
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def row_digests(tensor: Optional[torch.Tensor], samples: Optional[int] = None) -> List[int]:
    """One CRC-32 of the bytes of each sample of ``tensor``: exact, independent of how the batch
    was split or ordered; [] for a scalar or no tensor. Samples lie along the first dimension
    of ``samples`` entries (a time-major ``(T, B)`` batch: along B), else along the first.

    Example::

        row_digests(torch.zeros(3, 4))   # three equal checksums
        row_digests(torch.zeros(16, 4), samples=4)   # four: one a column
    """
    if tensor is None or tensor.dim() == 0:
        return []
    dim = next((d for d, size in enumerate(tensor.shape) if size == samples), 0)
    tensor = tensor.movedim(dim, 0)
    if tensor.shape[0] == 0:
        return []
    rows = tensor.detach().cpu().contiguous().reshape(tensor.shape[0], -1)
    raw = rows.view(torch.uint8) if rows.dtype.itemsize > 1 or rows.dtype == torch.bool \
        else rows
    data = raw.numpy() if raw.dtype != torch.bool else raw.to(torch.uint8).numpy()
    return [zlib.crc32(data[i].tobytes()) for i in range(data.shape[0])]


def _bytes_of(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return (flat.view(torch.uint8) if flat.dtype.itemsize > 1 else flat.to(torch.uint8)) \
        .numpy().tobytes()


def state_digests(modules: Iterable[nn.Module]) -> Dict[str, int]:
    """A CRC-32 of every parameter and buffer by name (``buffer:`` before buffers' names);
    sharded ones (FSDP2's DTensors: each rank holds another part) are left out.

    Example::

        state_digests([model])   # {'0.weight': 3817..., 'buffer:1.running_mean': 12...}
    """
    out: Dict[str, int] = {}
    for i, module in enumerate(modules):
        prefix = f"{i}/" if i else ""
        for name, param in module.named_parameters():
            if not hasattr(param, "to_local"):
                out[prefix + name] = zlib.crc32(_bytes_of(param))
        for name, buffer in module.named_buffers():
            if not hasattr(buffer, "to_local"):
                out[f"buffer:{prefix}{name}"] = zlib.crc32(_bytes_of(buffer))
    return out


def replica_digests(modules: List[nn.Module], optimizer: Any) -> Dict[str, Any]:
    """What data parallelism keeps the same on every rank, after an optimizer step: a CRC-32
    of every parameter and buffer, of the optimizer's state (momentum, Adam's moments, step
    counts) by parameter name, each param group's learning rate, and each module's ``training``
    flag (by module path). Compared between the ranks of one run, the first entry that differs
    names where the replicas parted.

    Example::

        replica_digests([model], opt)   # {'0.weight': 38..., 'optimizer:0.weight.exp_avg': ...}
    """
    out: Dict[str, Any] = dict(state_digests(modules))
    names = {id(p): (f"{i}/" if i else "") + n for i, m in enumerate(modules)
             for n, p in m.named_parameters()}
    for g, group in enumerate(getattr(optimizer, "param_groups", [])):
        out[f"lr:param_groups[{g}]"] = number(group.get("lr"))
        for k, param in enumerate(group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                name = f"optimizer:{names.get(id(param), f'group{g}.param{k}')}.{key}"
                if torch.is_tensor(value) and not hasattr(value, "to_local"):
                    out[name] = zlib.crc32(_bytes_of(value))
                elif isinstance(value, (int, float)):
                    out[name] = float(value)
    for i, module in enumerate(modules):
        prefix = f"{i}/" if i else ""
        for name, sub in module.named_modules():
            out[f"training:{prefix}{name or type(module).__name__}"] = sub.training
    return out


def call_site(depth: int = 2) -> Optional[str]:
    """``file:line`` of the script's code that called into torch, or None when that code is
    ddpkit's own (rt.evaluate, rt.mean: not the script's collectives).

    Example::

        call_site()   # 'train.py:42'
    """
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back
    if frame is None or os.path.abspath(frame.f_code.co_filename).startswith(_DDPKIT):
        return None
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _values(tensor: Any) -> Optional[List[float]]:
    if not torch.is_tensor(tensor) or tensor.numel() > _SMALL or tensor.is_complex():
        return None
    return [float(v) for v in tensor.detach().cpu().double().reshape(-1)]


def watch_collectives(record: Callable[[Dict[str, Any]], None],
                      gradients: Callable[[], Dict[int, str]]) -> List[Tuple[Any, Any]]:
    """Wrap ``torch.distributed``'s collectives so that each call from the script's own code
    is recorded (site, operation, size, small values before and after, whether it reduces a
    parameter's gradient); returns (original, wrapper) pairs.

    Example::

        pairs = watch_collectives(events.append, lambda: {})
    """
    import torch.distributed as tdist
    pairs = []
    for name in COLLECTIVES:
        original = getattr(tdist, name, None)
        if original is None:
            continue
        pairs.append((original, _watched(name, original, record, gradients)))
        setattr(tdist, name, pairs[-1][1])
    return pairs


def _watched(name: str, original: Callable, record: Callable[[Dict[str, Any]], None],
             gradients: Callable[[], Dict[int, str]]) -> Callable:
    def collective(*args: Any, **kwargs: Any) -> Any:
        site = call_site()
        if site is None:
            return original(*args, **kwargs)
        tensor = args[0] if args and torch.is_tensor(args[0]) else kwargs.get("tensor")
        op = kwargs.get("op", args[1] if len(args) > 1 and name in ("all_reduce", "reduce")
                        else None)
        event = {"event": "collective", "fn": name, "site": site,
                 "op": str(op).split(".")[-1] if op is not None else None,
                 "numel": int(tensor.numel()) if torch.is_tensor(tensor) else None,
                 "grad": gradients().get(id(tensor)) if torch.is_tensor(tensor) else None,
                 "before": _values(tensor)}
        result = original(*args, **kwargs)
        if not kwargs.get("async_op"):
            event["after"] = _values(tensor)
        record(event)
        return result
    collective.__wrapped__ = original  # type: ignore[attr-defined]
    return collective


def watch_losses(record: Callable[..., None]) -> List[Tuple[Any, Any]]:
    """Wrap ``cross_entropy``, ``nll_loss`` (and ``binary_cross_entropy_with_logits``: its
    ``weight=`` and ``pos_weight=``) to record, for each call, its reduction, over how
    many targets it averaged (the ``ignore_index`` ones left out), a CRC-32 of its ``weight=``
    (or None) and what a mean divides by (the targets' weights summed, with ``weight=``):
    per-rank means over unequal divisors are a mean of means; weights that differ between ranks
    are a quantity the replicas do not share.

    Example::

        pairs = watch_losses(lambda reduction, targets, weight, divisor: print(reduction, targets))
    """
    functional, pairs = torch.nn.functional, []
    for name in ("cross_entropy", "nll_loss"):
        original = getattr(functional, name)

        def counted(input: Any, target: Any, *args: Any, _original: Callable = original,
                    **kwargs: Any) -> Any:
            if torch.is_tensor(target) and not target.is_floating_point():
                ignore = kwargs.get("ignore_index", args[2] if len(args) > 2 else -100)
                weight = kwargs.get("weight", args[0] if args else None)
                kept = target[target != ignore]
                divisor = float(len(kept)) if not torch.is_tensor(weight) else \
                    float(weight.detach().float().cpu()[kept.cpu()].sum())
                record(kwargs.get("reduction", args[4] if len(args) > 4 else "mean"), len(kept),
                       zlib.crc32(_bytes_of(weight)) if torch.is_tensor(weight) else None,
                       divisor)
            return _original(input, target, *args, **kwargs)

        setattr(functional, name, counted)
        pairs.append((original, counted))
    original_bce = functional.binary_cross_entropy_with_logits

    def weighed(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        weights = [kwargs.get("weight", args[0] if args else None),
                   kwargs.get("pos_weight", args[4] if len(args) > 4 else None)]
        digest = [zlib.crc32(_bytes_of(w)) if torch.is_tensor(w) else None for w in weights]
        if torch.is_tensor(target):
            record(kwargs.get("reduction", args[3] if len(args) > 3 else "mean"),
                   int(target.numel()), None if digest == [None, None] else digest,
                   float(target.numel()))
        return original_bce(input, target, *args, **kwargs)

    functional.binary_cross_entropy_with_logits = weighed
    pairs.append((original_bce, weighed))
    return pairs


def quiet_attention(module: nn.Module, turned_off: Callable[[], None]) -> int:
    """Attention dropout inside torch's own modules off, as ``nn.Dropout`` is under verify
    (its masks depend on how the batch is split, by design); returns how many were.

    Example::

        quiet_attention(nn.TransformerEncoderLayer(16, 2), lambda: None)   # 1
    """
    count = 0
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            m.dropout, count = 0.0, count + 1
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention
    if not getattr(sdpa, "_ddpkit_quiet", False):
        def quiet(*args: Any, **kwargs: Any) -> Any:
            if len(args) > 4 and args[4]:
                args, _ = (*args[:4], 0.0, *args[5:]), turned_off()
            if kwargs.get("dropout_p"):
                kwargs["dropout_p"], _ = 0.0, turned_off()
            return sdpa(*args, **kwargs)
        quiet._ddpkit_quiet = True  # type: ignore[attr-defined]
        functional.scaled_dot_product_attention = quiet
    return count


class PrintTee:
    """``sys.stdout`` that also hands each whole line the rank prints to ``record`` (the first
    ``limit`` lines): a metric the script prints is compared between 1 and N processes.

    Example::

        sys.stdout = PrintTee(sys.stdout, lambda line: None)
    """

    def __init__(self, stream: Any, record: Callable[[str], None], limit: int = 400) -> None:
        self._stream, self._record, self._left, self._partial = stream, record, limit, ""

    def write(self, text: str) -> int:
        if self._left > 0:
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines[:self._left]:
                self._record(line)
            self._left -= len(lines)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def number(value: Any) -> Optional[float]:
    """A learning rate as a float (it may be a tensor), or None."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def param_sums(modules: List[nn.Module]) -> Optional[List[float]]:
    """Each parameter's and floating buffer's sum (float64), as the models stand: whether two
    runs' models still agree where a line was printed (BatchNorm's running statistics, taken
    from rank 0's batches alone on N processes, included). None for sharded (FSDP)
    parameters: a rank holds a part.

    Example::

        param_sums([model])   # [0.3152..., -1.27...]
    """
    params = [p for m in modules for p in m.parameters()]
    if any(hasattr(p, "to_local") for p in params):
        return None
    params += [b for m in modules for b in m.buffers() if b.is_floating_point()]
    return [float(p.detach().sum(dtype=torch.float64)) for p in params]


def autocast_dtype() -> Optional[str]:
    """"bfloat16"/"float16" inside an autocast region (CPU or GPU), else None."""
    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device):
                return str(torch.get_autocast_dtype(device)).replace("torch.", "")
        except (TypeError, AttributeError, RuntimeError):  # torch < 2.4 spells it otherwise
            return None
    return None


def norm(tensors: Any) -> float:
    """The 2-norm of all ``tensors`` together, in float64, one tensor at a time."""
    return sum(float(t.detach().double().norm()) ** 2 for t in tensors) ** 0.5


def reverse_batch(batch: Any, samples: Optional[int] = None) -> Any:
    """The same batch with its samples in reverse order (tensors, tuples, lists, dicts of them):
    along each tensor's first dimension of ``samples`` entries (a time-major ``(T, B)`` batch
    along B), the first dimension when ``samples`` is None or no dimension has that size.

    Example::

        reverse_batch((x, y))   # (x.flip(0), y.flip(0))
        reverse_batch(tokens_tb, samples=8)   # tokens of shape (16, 8): flipped along dim 1
    """
    if torch.is_tensor(batch):
        if not batch.dim():
            return batch
        dim = next((d for d, size in enumerate(batch.shape) if size == samples), 0)
        return batch.flip(dim)
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(reverse_batch(b, samples) for b in batch)
    if isinstance(batch, dict):
        return {k: reverse_batch(v, samples) for k, v in batch.items()}
    return batch


class ProbeHook:
    """A module hook that calls the probe, and pickles (``torch.save(model)``,
    ``copy.deepcopy(model)`` for an EMA or a teacher) as a hook that does nothing: the probe
    holds open files, and what the script saves must load where no probe runs."""

    def __init__(self, probe: Any, name: str) -> None:
        self.probe, self.name = probe, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return None if self.probe is None else getattr(self.probe, self.name)(*args, **kwargs)

    def __reduce__(self) -> Any:
        return ProbeHook, (None, self.name)


def rebind(replacements: Dict[Any, Any]) -> None:
    """Point the script's own names for each original (imported before setup) at its
    replacement."""
    by_id = {id(original): new for original, new in replacements.items()}
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith(("torch", "ddpkit")):
            continue
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict):
            for key, value in list(names.items()):
                if id(value) in by_id:  # the originals stay alive: ids are theirs
                    names[key] = by_id[id(value)]


def any_rank(count: int, optimizer: torch.optim.Optimizer, world_size: int) -> bool:
    """Is ``count`` above 0 on some rank? Asked of every rank at the same step, so all of
    them act on the same answer (a rank-0-only evaluation included).

    Example::

        any_rank(evaluations_done, optimizer, world_size)   # True once any rank evaluated
    """
    done = torch.tensor([float(count)])
    import torch.distributed as tdist
    if tdist.is_available() and tdist.is_initialized() and world_size > 1:
        param = next((p for g in optimizer.param_groups for p in g["params"]), None)
        device = param.device if param is not None and tdist.get_backend() == "nccl" \
            else torch.device("cpu")
        done = done.to(device)
        reduce = getattr(tdist.all_reduce, "__wrapped__", tdist.all_reduce)
        reduce(done, op=tdist.ReduceOp.MAX)
    return float(done) > 0
