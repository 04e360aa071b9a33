"""Extras that differ between ranks (an LSTM's hidden state carried across batches, a running
sum of this rank's batches): saved per rank and each rank restores its own.

At each save every rank hashes its extras (tensors by their bytes) and the digests are gathered
(one small collective); an extra equal on every rank is stored once, as before, one that
differs is gathered and stored as a list in rank order, named in ``extra_per_rank``. On the
same number of ranks each rank takes its own entry; on another number none can be mapped, so
each rank keeps the value it started with (the resume line says so). Checkpoints without
``extra_per_rank`` hold replicated extras only.

Example::

    entries = gather_extras({"hidden": h, "best": 0.9})   # every rank, at a save
    # on 2 ranks with different h: {"hidden": [h0, h1], "best": 0.9, ..., "extra_per_rank": ["hidden"]}
    mine, dropped = own_extras(ckpt, {"hidden": ckpt["hidden"]}, rank=1, world=2)
"""
from __future__ import annotations

import copy
import hashlib
import io
import pickle
from typing import Any, Dict, List, Mapping, Tuple

import torch

from ..engines import comm

__all__ = ["digest", "gather_extras", "own_extras"]

_PLAIN = (int, float, bool, str, bytes, complex, type(None))


def digest(value: Any) -> bytes:
    """A short hash of ``value``'s content: equal values give equal digests on any rank
    (tensors hashed by dtype, shape and bytes, wherever they live; other objects by their
    pickle, their tensors by content).

    Example::

        digest({"h": torch.zeros(2)}) == digest({"h": torch.zeros(2)})   # True
    """
    h = hashlib.blake2b(digest_size=16)
    _feed(h, value)
    return h.digest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(_tensor_digest(value))
    elif type(value) in _PLAIN:
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif type(value) in (dict, list, tuple) or isinstance(value, dict):
        h.update(f"{type(value).__qualname__}[{len(value)}".encode())
        for item in (value.items() if isinstance(value, dict) else value):
            _feed(h, item)
        h.update(b"]")
    elif type(value) in (set, frozenset):  # in an order that does not depend on string hashing
        h.update(f"{type(value).__name__}{{".encode() + b"".join(sorted(map(digest, value))))
    else:
        h.update(_pickled(value))


def _tensor_digest(t: torch.Tensor) -> bytes:
    t = t.detach()
    head = f"tensor:{t.dtype}:{tuple(t.shape)}:{t.layout};".encode()
    if t.layout != torch.strided or t.is_quantized or type(t) is not torch.Tensor:
        out = io.BytesIO()  # sparse, quantized, a subclass: torch.save's bytes (deterministic)
        torch.save(t.cpu(), out)
        return head + hashlib.blake2b(out.getvalue(), digest_size=16).digest()
    flat = t.resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return head + hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()


class _Pickler(pickle.Pickler):
    # tensors by content: pickle stores a storage with a key that changes from call to call
    def persistent_id(self, obj: Any) -> Any:
        return _tensor_digest(obj) if isinstance(obj, torch.Tensor) else None


def _pickled(value: Any) -> bytes:
    out = io.BytesIO()
    try:
        _Pickler(out, protocol=4).dump(value)
    except Exception:  # noqa: BLE001 - the same on every rank: the save itself will refuse it
        return f"unpicklable:{type(value).__qualname__}".encode()
    return out.getvalue()


def gather_extras(extras: Mapping[str, Any]) -> Dict[str, Any]:
    """The checkpoint's entries for ``extras`` (values or state dicts), on every rank (a
    collective: one gather of digests, a second of the values only when some differ): each
    extra equal on every rank as it is, each that differs as a list in rank order (tensors on
    the CPU), ``extra_names``: every extra's name, and ``extra_per_rank``: those that differ.

    Example::

        gather_extras({"hidden": h, "seen": 10})
        # on 2 ranks: {"hidden": [h_rank0, h_rank1], "seen": 10,
        #              "extra_names": ["hidden", "seen"], "extra_per_rank": ["hidden"]}
    """
    if comm.world_size() == 1:
        return {**extras, "extra_names": sorted(extras), "extra_per_rank": []}
    every = comm.gather_object({name: digest(value) for name, value in extras.items()})
    names = sorted({name for digests in every for name in digests})  # a name on some ranks only
    differ = [n for n in names if len({digests.get(n) for digests in every}) > 1]
    entries = dict(extras)
    if differ:
        values = comm.gather_object({n: _on_cpu(extras.get(n)) for n in differ})
        entries.update({n: [own[n] for own in values] for n in differ})
    return {**entries, "extra_names": sorted(entries), "extra_per_rank": differ}


def _on_cpu(value: Any) -> Any:
    # gathered to another process: a CUDA tensor would come back on this rank's device there
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps an OrderedDict an OrderedDict
        out.update((k, _on_cpu(v)) for k, v in value.items())
        return out
    if type(value) in (list, tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value


def own_extras(ckpt: Mapping[str, Any], saved: Mapping[str, Any], rank: int,
               world: int) -> Tuple[Dict[str, Any], List[str]]:
    """This rank's extras from ``saved`` (the checkpoint's entries by name): its own entry of
    each extra saved per rank when the checkpoint was written by ``world`` ranks; on another
    number none can be mapped, so they are left out (each rank keeps its starting value).
    Returns the extras and the names left out.

    Example::

        own_extras(ckpt, {"hidden": ckpt["hidden"], "best": ckpt["best"]}, rank=1, world=2)
        # ({"hidden": h_rank1, "best": 0.9}, [])   on 3 ranks: ({"best": 0.9}, ["hidden"])
    """
    per_rank = [n for n in ckpt.get("extra_per_rank") or () if n in saved]
    if not per_rank:  # an older checkpoint, or every extra the same on every rank
        return dict(saved), []
    same = ckpt.get("world_size") == world
    mine = {n: v for n, v in saved.items() if n not in per_rank}
    if same:
        mine.update({n: saved[n][rank] for n in per_rank})
    return mine, [] if same else per_rank
