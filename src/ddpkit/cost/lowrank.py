"""Batched PowerSGD: a DDP comm hook that compresses a whole gradient bucket as one matrix.

torch's ``powerSGD_hook`` compresses each gradient matrix of a bucket on its own: per tensor
Python work, a third all-reduce for the vectors it leaves uncompressed, and for a small model
more time than the bytes it saves. Its ``batched_powerSGD_hook`` views the bucket as one square
matrix instead, but fails on recent torch (its orthogonalisation asserts a batch of matrices).
This is the batched variant written again, with the same algorithm (Vogels et al., 2019):

    M  = the bucket, zero-padded to a side x side matrix, plus last step's error (error feedback)
    P  = M Q               all-reduced (side x r floats)
    P  = orthogonalise(P)
    Q  = M^T P             all-reduced (side x r floats), averaged
    M' = P Q^T             the bucket's gradients; error = M - M'

Q is kept from one step to the next (warm start), starting from the same random matrix on every
rank. For the first ``start_powerSGD_iter`` steps (at least 2: DDP rebuilds its buckets after
the first) the bucket is all-reduced uncompressed, as torch's hooks do. Computed in float32
(float64 for float64 gradients); bf16/fp16 buckets get the rounded approximation, and the error
memory keeps what the rounding lost. A bucket of n floats sends 2 ceil(sqrt(n)) r floats in two
all-reduces.

Example::

    state = BatchedPowerSGD(rank=2)
    ddp_model.register_comm_hook(state, batched_powersgd_hook)
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist

from .model import square_side

__all__ = ["BatchedPowerSGD", "batched_powersgd_hook"]


class BatchedPowerSGD:
    """State of :func:`batched_powersgd_hook`: its process group, rank, warm-up, and per bucket
    the error and Q kept between steps. Example::

        state = BatchedPowerSGD(rank=2, start_powerSGD_iter=10)
    """

    def __init__(self, process_group: Any = None, rank: int = 2,
                 start_powerSGD_iter: int = 10, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD's rank must be at least 1, not {rank}")
        if start_powerSGD_iter < 2:   # as torch's PowerSGDState: DDP rebuilds its buckets
            raise ValueError("start_powerSGD_iter must be at least 2: DDP rebuilds its buckets "
                             f"after the first step, got {start_powerSGD_iter}")
        self.process_group = process_group
        self.matrix_approximation_rank = rank
        self.start_powerSGD_iter = start_powerSGD_iter   # the names torch's PowerSGDState uses
        self.iter = 0
        self.seed = seed
        self.error: Dict[int, torch.Tensor] = {}
        self.q: Dict[int, torch.Tensor] = {}

    def __getstate__(self) -> Dict[str, Any]:   # DDP pickles hook states with the model
        return {k: v for k, v in self.__dict__.items() if k != "process_group"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None

    def _advance(self, bucket: Any) -> None:
        if bucket.is_last():
            self.iter += 1


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``matrix``'s (Householder QR). Gram-Schmidt, as torch's
    hooks use for ranks up to 2, turns a dependent column's rounding residue into a unit column
    partly inside the others' span, and the approximation is then no longer a projection (a
    zero-padded bucket at full rank came back 25-90% off); QR's columns stay orthonormal, and
    are identical on every rank for the same all-reduced input."""
    return torch.linalg.qr(matrix, mode="reduced").Q


def batched_powersgd_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: the bucket compressed as one square matrix of rank ``state``'s rank, with
    error feedback (see the module's docstring). Not annotated on purpose: DDP checks
    annotations against its own GradBucket/Future classes.

    Both all-reduces are issued here, on the thread DDP calls the hook on, in bucket order: P's
    is waited for (it is small), Q's is returned. Issuing Q's from P's completion callback, as
    torch's hooks do, lets gloo's worker threads issue the buckets' collectives in a different
    order on different ranks, and blocks those threads. The error memory is the matrix itself:
    the bucket is added to it, and the approximation, written straight into the bucket, is
    taken off it (no padded copy, no second matrix).

    Example::

        ddp_model.register_comm_hook(BatchedPowerSGD(rank=1), batched_powersgd_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    warm_up = state.iter < state.start_powerSGD_iter
    state._advance(bucket)
    if warm_up:                                  # uncompressed, averaged
        fut = dist.all_reduce(buffer.div_(world), group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    index, numel = bucket.index(), buffer.numel()
    side = square_side(numel)
    rank = min(state.matrix_approximation_rank, side)
    dtype = torch.float64 if buffer.dtype == torch.float64 else torch.float32
    memory = state.error.get(index)
    if memory is None or memory.numel() != side * side or memory.device != buffer.device \
            or memory.dtype != dtype:
        memory = state.error[index] = torch.zeros(side * side, device=buffer.device, dtype=dtype)
    memory[:numel].add_(buffer)                  # M = this step's gradients + last step's error
    matrix = memory.view(side, side)
    q = state.q.get(index)
    if q is None or q.shape != (side, rank) or q.dtype != dtype:
        gen = torch.Generator().manual_seed(state.seed + index)  # the same Q on every rank
        q = torch.randn(side, rank, generator=gen, dtype=dtype).to(buffer.device)
    p = matrix @ _orthonormal(q)
    dist.all_reduce(p, group=group)              # P summed: waited for, so Q follows in order
    p = _orthonormal(p)
    q = matrix.t() @ p
    q_fut = dist.all_reduce(q, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        q_sum = fut.value()[0].div_(world)
        state.q[index] = q_sum
        # the approximation P Q^T: whole rows straight into the bucket, the last (partly
        # padding) rows apart; then taken off M, which is left holding the new error
        rows = numel // side
        out = buffer if buffer.dtype == dtype else torch.empty(numel, device=buffer.device,
                                                               dtype=dtype)
        torch.mm(p[:rows], q_sum.t(), out=out[:rows * side].view(rows, side))
        tail = (p[rows:] @ q_sum.t()).view(-1)
        out[rows * side:].copy_(tail[:numel - rows * side])
        if out is not buffer:
            buffer.copy_(out)                    # rounded: what is sent is what is taken off
        memory[:numel].sub_(buffer)
        memory[numel:].sub_(tail[numel - rows * side:])
        return buffer

    return q_fut.then(decompress)
