"""DDP's first synchronised step all-reduced in the buckets of every later step, so that a run
resumed from a checkpoint adds its gradients up exactly as the uninterrupted run did.

Why: DDP reduces its first step in one bucket per dtype, its gradients in the reverse order of
``model.parameters()``, then rebuilds its buckets in the order gradients became ready (1 MB
first, then ``bucket_cap_mb``). A resumed run's first step is that one-bucket step again, where
the uninterrupted run used the rebuilt buckets. On 2 ranks that
changes nothing (a + b = b + a), but from 3 ranks on, the ring all-reduce's partial sums depend
on where each bucket starts: the resumed weights differed in the last bits (6e-8 after 30 steps
on 3 ranks). Here a comm hook splits the first step's bucket into the rebuilt buckets before it
all-reduces; later steps are all-reduced bucket by bucket by the same hook, as DDP would.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SteadyBuckets", "install_steady_buckets"]


class SteadyBuckets:
    """State of the comm hook :func:`steady_allreduce`: the order gradients became ready (the
    order DDP rebuilds its buckets in) and the size limits DDP rebuilds with.

    Example::

        state = SteadyBuckets(ddp_model)
        ddp_model.register_comm_hook(state, steady_allreduce)
    """

    def __init__(self, ddp: nn.Module) -> None:
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        self.limits = rebuild_limits(ddp)
        self.first = True            # the first synchronised step: DDP's initial buckets
        self.ready: Dict[nn.Parameter, int] = {}
        self.segments: List[List[nn.Parameter]] = []   # what the first step all-reduced apart
        #: whether DDP's rebuilt buckets were those pieces (None: not compared yet)
        self.matched: Optional[bool] = None
        self._seen: List[tuple] = []
        self.seen: List[tuple] = []   # the rebuilt buckets' parameters (ids), once compared
        self._count = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._mark)
                         for p in ddp.module.parameters() if p.requires_grad]

    def _mark(self, param: nn.Parameter) -> None:
        self._count += 1           # the latest backward's order wins: no_sync steps come first
        self.ready[param] = self._count

    def done_with_first(self) -> None:
        self.first = False
        for handle in self._handles:
            handle.remove()
        self._handles, self.ready = [], {}   # no reference to the parameters kept

    def check(self, bucket: Any) -> None:
        """At the second step: were DDP's rebuilt buckets the first step's pieces?"""
        if not self.segments:
            return
        self._seen.append(tuple(map(id, bucket.parameters())))
        if bucket.is_last():
            self.matched = sorted(self._seen) == sorted(tuple(map(id, s)) for s in self.segments)
            self.seen, self.segments, self._seen = self._seen, [], []

    def layout(self, params: List[nn.Parameter]) -> List[List[int]]:
        """The buckets DDP will rebuild ``params`` (one bucket's, one dtype) into: positions in
        ``params``, each bucket in ready order."""
        order = sorted(range(len(params)), key=lambda i: self.ready.get(params[i], 0))
        tensors = [params[i] for i in order]
        buckets, _ = dist._compute_bucket_assignment_by_size(  # DDP's own assignment
            tensors, self.limits, [False] * len(tensors), list(range(len(tensors))))
        return [[order[j] for j in bucket] for bucket in buckets]


def rebuild_limits(ddp: nn.Module) -> List[int]:
    """The bucket size limits DDP rebuilds its buckets with (torch 2.4 to 2.13 set them so).

    Example::

        rebuild_limits(ddp_model)   # [1048576, 26214400] at the defaults
    """
    caps = list(getattr(ddp, "bucket_bytes_cap_list", None) or [])
    if caps:
        return caps
    cap = int(ddp.bucket_bytes_cap)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if getattr(ddp, "bucket_bytes_cap_default", False) \
        else cap
    config = getattr(ddp, "_bucket_config", None)  # torch >= 2.13 says it directly
    if config is not None:
        first = int(config.first_bucket_bytes_cap)
    return [first, cap]


def steady_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: the mean of the bucket over the ranks (divide, then sum, as torch's
    ``allreduce_hook``); the first step's bucket in the pieces later steps' buckets hold.
    Not annotated on purpose: DDP checks annotations against its own classes.

    Example::

        ddp_model.register_comm_hook(SteadyBuckets(ddp_model), steady_allreduce)
    """
    buffer = bucket.buffer()
    if not state.first:
        state.check(bucket)
        return _mean(buffer, state).then(lambda fut: fut.value()[0])
    params, grads = bucket.parameters(), bucket.gradients()
    layout = state.layout(params)
    if bucket.is_last():
        state.done_with_first()
    state.segments.extend([params[i] for i in piece] for piece in layout)
    for piece in layout:  # one at a time, each waited for: only at the first step
        part = [grads[i] for i in piece]
        flat, copied = _flat(part, buffer)
        flat.div_(state.world)
        dist.all_reduce(flat, group=state.group)
        if copied:  # back into the bucket
            offset = 0
            for grad in part:
                grad.view(-1).copy_(flat[offset:offset + grad.numel()])
                offset += grad.numel()
    # on a GPU the future waits for this stream's work (the reducer reads the bucket after it)
    done = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    done.set_result(buffer)
    return done


def _mean(tensor: torch.Tensor, state: SteadyBuckets) -> torch.futures.Future:
    tensor.div_(state.world)
    return dist.all_reduce(tensor, group=state.group, async_op=True).get_future()


def _flat(grads: List[torch.Tensor], buffer: torch.Tensor) -> tuple:
    """The gradients as one flat tensor in this order: a slice of ``buffer`` where they lie
    next to each other in it (no copy), else a copy (``copied``: written back after)."""
    size = buffer.element_size()
    start = (grads[0].data_ptr() - buffer.data_ptr()) // size
    offset = start
    for g in grads:
        if g.data_ptr() != buffer.data_ptr() + offset * size or not g.is_contiguous():
            return torch.cat([g.reshape(-1) for g in grads]), True
        offset += g.numel()
    return buffer[start:offset], False


def install_steady_buckets(ddp: nn.Module) -> None:
    """At ``ddp``'s first training forward, register :func:`steady_allreduce` unless a comm
    hook is registered by then (the script's own, or ``comm_hook=``): then theirs stays, and a
    resume on 3 or more ranks may differ from an uninterrupted run in the last bits.

    Example::

        install_steady_buckets(DistributedDataParallel(model))
    """
    if ddp.find_unused_parameters or getattr(ddp, "static_graph", False) or \
            os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1" or \
            any(getattr(m, "sparse", False) for m in ddp.module.modules()
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag))):
        # no rebuild (the first buckets stay) / a rebuild or gradients it does not copy: under
        # static_graph DDP delays the first step's all-reduce and rebuilds later, in another order
        # (3 ranks: resumes 2.4e-7 apart with or without this hook; not matched yet)
        return

    def first_forward(module: nn.Module, args: Any) -> Optional[Any]:
        if not torch.is_grad_enabled():
            return None  # evaluation: wait for a training step
        handle.remove()
        if getattr(module, "_comm_hooks", None):
            return None
        try:
            module.register_comm_hook(SteadyBuckets(module), steady_allreduce)
        except RuntimeError:  # a built-in hook was registered: it stays
            pass
        return None

    handle = ddp.register_forward_pre_hook(first_forward)
