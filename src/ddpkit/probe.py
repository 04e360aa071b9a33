"""What ``ddpkit verify`` sees inside a user's unchanged script: with ``DDPKIT_VERIFY`` set,
``setup()`` records every optimizer step of this rank (the samples consumed, the losses
backpropagated, the gradient norm before clipping, the learning rate, a digest of the
parameters after the step) as JSON lines, and ends the run after ``DDPKIT_VERIFY_STEPS`` steps.

Nothing here runs unless ``ddpkit verify`` (or a test) sets the variable; ``ddpkit.verify``
compares the records of 1 and N processes and names what differs.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import types
from typing import Any, Dict, List, Optional

import torch
from torch import nn

__all__ = ["VERIFY_VAR", "STEPS_VAR", "ORDER_VAR", "ACCUM_VAR", "Probe", "start", "active", "reverse_batch"]

#: The directory each rank writes ``rank{R}.jsonl`` into; set by ``ddpkit verify``.
VERIFY_VAR = "DDPKIT_VERIFY"
#: Optimizer steps to record before the run ends (exit status 0).
STEPS_VAR = "DDPKIT_VERIFY_STEPS"
#: "reverse": every batch from ``rt.loader`` in reverse order (the same samples, another
#: reduction order: the spread it causes is verify's measured tolerance).
ORDER_VAR = "DDPKIT_VERIFY_ORDER"
#: K > 1 on one process: ``rt.loader`` hands out K ranks' batches in turn and every K-th
#: optimizer step (zero_grad, scheduler step, clipping) happens, the others are accumulated.
ACCUM_VAR = "DDPKIT_VERIFY_ACCUM"

_ACTIVE: Optional["Probe"] = None


def active() -> Optional["Probe"]:
    """The probe of this process while ``ddpkit verify`` runs it, else None.

    Example::

        if active() is not None: active().batch(indices)
    """
    return _ACTIVE


def start(rank: int, world_size: int, environ: Any = None,
          seeded: bool = True) -> Optional["Probe"]:
    """Install the probe when ``DDPKIT_VERIFY`` is set (``setup`` calls this); else None.

    Example::

        probe = start(rt.rank, rt.world_size)
    """
    global _ACTIVE
    environ = os.environ if environ is None else environ
    directory = environ.get(VERIFY_VAR)
    if not directory or _ACTIVE is not None:
        return _ACTIVE
    _ACTIVE = Probe(directory, rank, world_size, int(environ.get(STEPS_VAR, "10")),
                    environ.get(ORDER_VAR) == "reverse", seeded,
                    int(environ.get(ACCUM_VAR, "1")) if world_size == 1 else 1)
    _ACTIVE.install()
    return _ACTIVE


def reverse_batch(batch: Any) -> Any:
    """The same batch with its samples in reverse order (tensors, tuples, lists, dicts of them).

    Example::

        reverse_batch((x, y))   # (x.flip(0), y.flip(0))
    """
    if torch.is_tensor(batch):
        return batch.flip(0) if batch.dim() else batch
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(reverse_batch(b) for b in batch)
    if isinstance(batch, dict):
        return {k: reverse_batch(v) for k, v in batch.items()}
    return batch


class Probe:
    """One rank's recorder. Example::

        probe = Probe("/tmp/verify/n2", rank=0, world_size=2, steps=10); probe.install()
    """

    def __init__(self, directory: str, rank: int, world_size: int, steps: int,
                 reverse: bool = False, seeded: bool = True, accum: int = 1) -> None:
        self.rank, self.world_size, self.steps, self.reverse = rank, world_size, steps, reverse
        self.accum = accum                # micro-batches per optimizer step (one process)
        self._calls = 0                   # optimizer.step() calls (every accum-th happens)
        os.makedirs(directory, exist_ok=True)
        self._out = open(os.path.join(directory, f"rank{rank}.jsonl"), "w", buffering=1)
        self.step = 0
        self._indices: List[int] = []     # samples consumed since the last optimizer step
        self._losses: List[float] = []    # losses backpropagated since the last step
        self._clipped: Optional[float] = None  # clip_grad_norm_'s answer: the norm before it
        self._random_forward = False      # did a forward draw random numbers since the last step
        self._random_loop = False         # did the loop draw between a batch and the forward
        self._after_batch: Optional[torch.Tensor] = None  # the RNG as a batch was handed out
        self._models: List[nn.Module] = []
        self._write({"event": "start", "rank": rank, "world_size": world_size,
                     "seed": torch.initial_seed(), "seeded": seeded, "accum": accum,
                     "argv": sys.argv})

    # ------------------------------------------------------------------ set-up
    def install(self) -> None:
        """Hooks on every optimizer step, ``torch.autograd.backward`` and ``clip_grad_norm_``."""
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)
        backward = torch.autograd.backward

        def recorded_backward(tensors: Any, grad_tensors: Any = None, *args: Any,
                              **kwargs: Any) -> Any:
            if torch.is_tensor(tensors) and tensors.numel() == 1:
                self._losses.append(float(tensors.detach()) / self.accum)
                if self.accum > 1:  # K micro-batches make one step: each counts 1/K
                    grad_tensors = torch.full_like(tensors, 1.0 / self.accum) \
                        if grad_tensors is None else grad_tensors / self.accum
            return backward(tensors, grad_tensors, *args, **kwargs)

        torch.autograd.backward = recorded_backward
        clip = torch.nn.utils.clip_grad_norm_

        def recorded_clip(parameters: Any, max_norm: float, *args: Any,
                          **kwargs: Any) -> torch.Tensor:
            if (self._calls + 1) % self.accum:  # the next step is held back: clip at the last
                max_norm = float("inf")
            norm = clip(parameters, max_norm, *args, **kwargs)
            self._clipped = float(norm)
            return norm

        torch.nn.utils.clip_grad_norm_ = recorded_clip
        torch.nn.utils.clip_grad.clip_grad_norm_ = recorded_clip
        iterate = torch.utils.data.DataLoader.__iter__

        def watched_iter(loader: Any) -> Any:
            if not getattr(loader, "_ddpkit_owned", False):
                self.foreign_loader()
            return iterate(loader)

        torch.utils.data.DataLoader.__iter__ = watched_iter  # type: ignore[method-assign]
        if self.accum > 1:
            self._hold_back_steps()

    def _hold_back_steps(self) -> None:
        """Accumulate ``accum`` micro-batches per step in a loop that steps on every batch: the
        optimizer steps every ``accum``-th call; zero_grad, the scheduler and clipping follow."""
        from torch.optim import Optimizer
        from torch.optim.lr_scheduler import LRScheduler
        probe, accum = self, self.accum

        def gated_step(opt: Any, *args: Any, **kwargs: Any) -> Any:
            probe._calls += 1
            return type(opt).step(opt, *args, **kwargs) if probe._calls % accum == 0 else None

        def unless_pending(method: Any) -> Any:  # only right after a step that happened
            def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
                return method(obj, *args, **kwargs) if probe._calls % accum == 0 else None
            return call

        init = Optimizer.__init__

        def gated_init(opt: Any, *args: Any, **kwargs: Any) -> None:
            init(opt, *args, **kwargs)
            opt.step = types.MethodType(gated_step, opt)  # a bound method, as schedulers expect

        Optimizer.__init__ = gated_init  # type: ignore[method-assign]
        Optimizer.zero_grad = unless_pending(Optimizer.zero_grad)  # type: ignore[method-assign]
        nn.Module.zero_grad = unless_pending(nn.Module.zero_grad)  # type: ignore[method-assign]
        LRScheduler.step = unless_pending(LRScheduler.step)  # type: ignore[method-assign]

    def model(self, module: nn.Module) -> None:
        """``rt.wrap`` hands over the user's module: turn its Dropout modules off (their masks
        depend on how the batch is split, by design) and watch what its forward draws."""
        dropouts = [m for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd)
                    and m.p > 0]
        for m in dropouts:
            m.p = 0.0
        norms = [type(m).__name__ for m in module.modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and not isinstance(m, nn.SyncBatchNorm)]
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)
        self._models.append(module)
        self._write({"event": "model", "type": type(module).__name__, "dropouts_off":
                     len(dropouts), "batchnorms": len(norms)})

    def loader(self, config: Dict[str, Any]) -> None:
        """``rt.loader`` says how it was built (seed, shuffle, drop_last, batch)."""
        self._write({"event": "loader", **config})

    def foreign_loader(self) -> None:
        """A DataLoader that is not ``rt.loader``'s was iterated (a sampler of the script's own)."""
        self._write({"event": "foreign_loader", "step": self.step})

    def batch(self, indices: List[int], last: bool) -> None:
        """``rt.loader`` handed out a batch of these samples (``last``: the epoch's last)."""
        self._indices.extend(int(i) for i in indices)
        self._after_batch = torch.random.get_rng_state()
        if last:
            self._write({"event": "epoch_end", "step": self.step})

    # ------------------------------------------------------------------ hooks
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        module._ddpkit_rng = torch.random.get_rng_state()
        if self._after_batch is not None and not torch.equal(self._after_batch,
                                                             module._ddpkit_rng):
            self._random_loop = True      # noise, mixup, a random crop in the loop itself
        self._after_batch = None

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        before = getattr(module, "_ddpkit_rng", None)
        if before is not None and not torch.equal(before, torch.random.get_rng_state()):
            self._random_forward = True

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad.detach().double() for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) \
            if grads else 0.0
        self._grad = {"grad_norm": self._clipped if self._clipped is not None else norm,
                      "no_grad": [self._name(p, i) for i, p in enumerate(params)
                                  if p.grad is None]}

    def _name(self, param: torch.Tensor, index: int) -> str:
        for module in self._models:
            for name, candidate in module.named_parameters():
                if candidate is param:
                    return name
        return f"parameter {index}"

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step += 1
        params = [p.detach().double() for group in optimizer.param_groups
                  for p in group["params"]]
        record = {"event": "step", "step": self.step, "samples": self._indices,
                  "losses": self._losses, "lr": _number(optimizer.param_groups[0].get("lr")),
                  "random_forward": self._random_forward, "random_loop": self._random_loop,
                  "param_sums": [float(p.sum()) for p in params],
                  "param_norm": float(torch.linalg.vector_norm(
                      torch.stack([p.norm() for p in params]))) if params else 0.0,
                  **getattr(self, "_grad", {})}
        self._write(record)
        self._indices, self._losses, self._clipped = [], [], None
        self._random_forward = self._random_loop = False
        if self.step >= self.steps:
            self._finish()

    def _finish(self) -> None:
        """Enough steps: end this rank now, as every rank does after the same step."""
        self._write({"event": "done", "step": self.step})
        self._out.close()
        with contextlib.suppress(Exception):
            import torch.distributed as tdist
            if tdist.is_initialized():
                tdist.barrier()  # every rank has written its records before any leaves
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _write(self, record: Dict[str, Any]) -> None:
        self._out.write(json.dumps(record) + "\n")


def _number(value: Any) -> Optional[float]:
    """A learning rate as a float (it may be a tensor), or None."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
