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
import signal
import sys
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .microsteps import HoldBack

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
        self._hold: Optional[HoldBack] = None  # accum > 1: optimizer steps held back
        self._loss_scale = 1.0            # GradScaler's factor on the next backward's loss
        self._grad: Dict[str, Any] = {}   # the gradients as the step about to happen saw them
        self._watching_loader = False     # the first rt.loader is the one recorded
        os.makedirs(directory, exist_ok=True)
        self._out = open(os.path.join(directory, f"rank{rank}.jsonl"), "w", buffering=1)
        self.step = 0
        self._indices: List[int] = []     # samples consumed since the last optimizer step
        self._losses: List[float] = []    # losses backpropagated since the last step
        self._clipped: Optional[float] = None  # clip_grad_norm_'s answer: the norm before it
        self._random_forward = False      # did a forward draw random numbers since the last step
        self._random_loop = False         # did the loop draw between a batch and the forward
        self._after_batch: Optional[List[torch.Tensor]] = None  # RNGs as a batch was handed out
        self._dtypes: set = set()         # autocast dtypes seen in a forward
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
            if torch.is_tensor(tensors) and tensors.numel() == 1:  # the loss, unscaled
                self._losses.append(float(tensors.detach()) / self.accum / self._loss_scale)
                self._loss_scale = 1.0
            if self.accum > 1:  # K micro-batches make one step: each counts 1/K
                grad_tensors = _divided(tensors, grad_tensors, self.accum)
            return backward(tensors, grad_tensors, *args, **kwargs)

        torch.autograd.backward = recorded_backward
        self._watch_loss_scale()
        clip = torch.nn.utils.clip_grad_norm_

        def recorded_clip(parameters: Any, max_norm: float, *args: Any,
                          **kwargs: Any) -> torch.Tensor:
            if self._hold is not None and not self._hold.stepping():  # clip the whole step
                max_norm = float("inf")
            norm = clip(parameters, max_norm, *args, **kwargs)
            self._clipped = float(norm)
            return norm

        torch.nn.utils.clip_grad_norm_ = recorded_clip
        torch.nn.utils.clip_grad.clip_grad_norm_ = recorded_clip
        _rebind(clip, recorded_clip)  # `from torch.nn.utils import clip_grad_norm_` in scripts
        iterate = torch.utils.data.DataLoader.__iter__

        def watched_iter(loader: Any) -> Any:
            if not getattr(loader, "_ddpkit_owned", False):
                self.foreign_loader()
            return iterate(loader)

        torch.utils.data.DataLoader.__iter__ = watched_iter  # type: ignore[method-assign]
        if self.accum > 1:
            self._hold = HoldBack(self.accum)
            self._hold.install()

    def _watch_loss_scale(self) -> None:
        """GradScaler.scale(loss): remember the factor, so the loss recorded is the loss."""
        try:
            from torch.amp import GradScaler
        except ImportError:
            return
        scale = GradScaler.scale

        def scaled(scaler: Any, outputs: Any) -> Any:
            if torch.is_tensor(outputs) and scaler.is_enabled():
                self._loss_scale = float(scaler.get_scale()) or 1.0
            return scale(scaler, outputs)

        GradScaler.scale = scaled  # type: ignore[method-assign]

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

    def claim_loader(self) -> bool:
        """True for the script's first ``rt.loader`` (the training data): the one whose batches
        are recorded, and split into micro-batches under ``--accum-steps``."""
        first, self._watching_loader = not self._watching_loader, True
        return first

    def loader(self, config: Dict[str, Any]) -> None:
        """``rt.loader`` says how it was built (seed, shuffle, drop_last, batch)."""
        self._write({"event": "loader", **config})

    def foreign_loader(self) -> None:
        """A DataLoader that is not ``rt.loader``'s was iterated (a sampler of the script's own)."""
        self._write({"event": "foreign_loader", "step": self.step})

    def batch(self, indices: List[int], last: bool) -> None:
        """``rt.loader`` handed out a batch of these samples (``last``: the epoch's last)."""
        self._indices.extend(int(i) for i in indices)
        self._after_batch = _rng()
        if last:
            self._write({"event": "epoch_end", "step": self.step})

    # ------------------------------------------------------------------ hooks
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        module._ddpkit_rng = _rng()
        if self._after_batch is not None and not _same(self._after_batch, module._ddpkit_rng):
            self._random_loop = True      # noise, mixup, a random crop in the loop itself
        self._after_batch = None
        dtype = _autocast_dtype()
        if dtype is not None and dtype not in self._dtypes:
            self._dtypes.add(dtype)
            self._write({"event": "autocast", "dtype": dtype})

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        before = getattr(module, "_ddpkit_rng", None)
        if before is not None and not _same(before, _rng()):
            self._random_forward = True

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._hold is not None:
            self._hold.check(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = self._clipped if self._clipped is not None else \
            _norm(p.grad for p in params if p.grad is not None)  # clipping measured it already
        self._grad = {"grad_norm": norm,
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
        params = [p.detach() for group in optimizer.param_groups for p in group["params"]]
        record = {"event": "step", "step": self.step, "samples": self._indices,
                  "losses": self._losses, "lr": _number(optimizer.param_groups[0].get("lr")),
                  "random_forward": self._random_forward, "random_loop": self._random_loop,
                  "param_sums": [float(p.sum(dtype=torch.float64)) for p in params],
                  "param_norm": _norm(params),
                  **self._grad}
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
        # DataLoader workers hold our pipes: kill them, with the SIGCHLD handler the DataLoader
        # installed (it raises "worker killed by signal" in this thread) put back first.
        import multiprocessing
        with contextlib.suppress(ValueError):  # not the main thread: no handler of ours ran
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            with contextlib.suppress(Exception):
                child.kill()
        os._exit(0)

    def _write(self, record: Dict[str, Any]) -> None:
        self._out.write(json.dumps(record) + "\n")


def _number(value: Any) -> Optional[float]:
    """A learning rate as a float (it may be a tensor), or None."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _rng() -> List[torch.Tensor]:
    """The CPU generator's state, and the current GPU's once CUDA is in use (dropout on a GPU
    draws from that one)."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _autocast_dtype() -> Optional[str]:
    """"bfloat16"/"float16" inside an autocast region (CPU or GPU), else None."""
    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device):
                return str(torch.get_autocast_dtype(device)).replace("torch.", "")
        except (TypeError, AttributeError, RuntimeError):  # torch < 2.4 spells it otherwise
            return None
    return None


def _norm(tensors: Any) -> float:
    """The 2-norm of all ``tensors`` together, in float64, one tensor at a time."""
    return sum(float(t.detach().double().norm()) ** 2 for t in tensors) ** 0.5


def _divided(tensors: Any, grads: Any, k: int) -> Any:
    """``backward``'s gradient arguments for ``tensors`` divided by ``k``."""
    if grads is None:
        return torch.full_like(tensors, 1.0 / k) if torch.is_tensor(tensors) and \
            tensors.numel() == 1 else None
    if torch.is_tensor(grads):
        return grads / k
    return type(grads)(None if g is None else g / k for g in grads)


def _rebind(original: Any, replacement: Any) -> None:
    """Point the script's own names for ``original`` (imported before setup) at ``replacement``."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith(("torch", "ddpkit")):
            continue
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict):
            for key, value in list(names.items()):
                if value is original:
                    names[key] = replacement
