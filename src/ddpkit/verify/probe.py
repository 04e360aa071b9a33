"""What ``ddpkit verify`` sees inside a user's unchanged script: the observer ``setup()`` starts
(``ddpkit.base.observe``) when ``ddpkit verify`` sets ``DDPKIT_OBSERVER`` and ``DDPKIT_VERIFY``; it records every optimizer step of this rank (the samples consumed, the losses
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
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import probe_watch as watch
from .microsteps import HoldBack
from .probe_loader import LoaderWatch
from .probe_watch import ProbeHook as _Hook, rebind as _rebind, reverse_batch

__all__ = ["VERIFY_VAR", "STEPS_VAR", "ORDER_VAR", "ACCUM_VAR", "EVAL_VAR", "Probe", "start",
           "active", "reverse_batch"]

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
#: E > 0: after the recorded steps, train on for up to E more optimizer steps until the
#: script's first evaluation has ended (what it evaluated and printed is then compared).
EVAL_VAR = "DDPKIT_VERIFY_EVAL_WITHIN"

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
                    int(environ.get(ACCUM_VAR, "1")) if world_size == 1 else 1,
                    int(environ.get(EVAL_VAR, "0")))
    _ACTIVE.install()
    return _ACTIVE


#: Optimizer steps recorded after the first evaluation (mid-training): what it changed on some
#: ranks only (a random generator, a module's mode) shows in them.
AFTER_EVAL = 2


class Probe(LoaderWatch):
    """One rank's recorder. Example::

        probe = Probe("/tmp/verify/n2", rank=0, world_size=2, steps=10); probe.install()
    """

    def __init__(self, directory: str, rank: int, world_size: int, steps: int,
                 reverse: bool = False, seeded: bool = True, accum: int = 1,
                 eval_within: int = 0) -> None:
        self.rank, self.world_size, self.steps, self.reverse = rank, world_size, steps, reverse
        self.eval_within = eval_within    # steps to train on to reach the first evaluation
        self._stop_at: Optional[int] = None  # the last step recorded, once it is known
        self.accum = accum                # micro-batches per optimizer step (one process)
        self._hold: Optional[HoldBack] = None  # accum > 1: optimizer steps held back
        self._loss_scale = 1.0            # GradScaler's factor on the next backward's loss
        self._grad: Dict[str, Any] = {}   # the gradients as the step about to happen saw them
        self._watching_loader = False     # the first rt.loader is the one recorded
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._forward_rng: Dict[int, Any] = {}  # module id -> RNG states as its forward began
        self._out = open(os.path.join(directory, f"rank{rank}.jsonl"), "w", buffering=1)
        self.step = 0
        self._indices: List[int] = []     # samples consumed since the last optimizer step
        self._batch_samples: Optional[int] = None  # samples in the batch just handed out
        self._pending: Optional[Tuple[List[int], bool]] = None  # (its samples, epoch's last)
        self._untrained = 0               # batches in a row no training forward took
        self._losses: List[float] = []    # losses backpropagated since the last step
        self._clipped: Optional[float] = None  # clip_grad_norm_'s answer: the norm before it
        self._random_forward = False      # did a forward draw random numbers since the last step
        self._random_loop = False         # did the loop draw between a batch and the forward
        self._after_batch: Optional[List[torch.Tensor]] = None  # RNGs as a batch was handed out
        self._dtypes: set = set()         # autocast dtypes seen in a forward
        self._models: List[nn.Module] = []
        self._training: Dict[int, Tuple[int, bool]] = {}  # id(optimizer) -> (models, updates)
        self._trained: set = set()        # ids of the models a training forward ran through
        self._rows: List[int] = []        # checksums of the samples this step's forwards got
        self._loss_counts: List[List[Any]] = []  # each loss call: reduction, targets, weight=
        self._eval: Optional[List[int]] = None  # an evaluation in progress: its samples
        self._evals = 0                   # evaluations ended
        self._evals_at_step = 0           # ... by the last optimizer step
        self._unseen_draws = False        # random draws since it that a restore hid, or in workers
        self._rng_at_step = watch.rng()   # the generators as the last step ended
        self._counts = {"batches": 0, "forwards": 0, "rows": 0}
        self._stepped_since_forward = True  # the next training forward starts a step
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
            if not self._models:  # before rt.wrap: a model of the script's own (pretrained)
                return backward(tensors, grad_tensors, *args, **kwargs)
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
        iterate = torch.utils.data.DataLoader.__iter__

        def watched_iter(loader: Any) -> Any:
            if not getattr(loader, "_ddpkit_owned", False):
                self.foreign_loader()
            if getattr(loader, "num_workers", 0) > 0:  # draws there are out of sight
                self._unseen_draws = True
            return iterate(loader)

        torch.utils.data.DataLoader.__iter__ = watched_iter  # type: ignore[method-assign]
        if self.accum > 1:
            self._hold = HoldBack(self.accum, self._trains)
            self._hold.install()
        pairs = watch.watch_collectives(self._collective, self._gradients) + \
            watch.watch_losses(lambda *call: self._loss_counts.append(list(call)))
        # `from torch.nn.utils import clip_grad_norm_`, `from torch.distributed import
        # all_reduce` in scripts: their names too, in one pass over the loaded modules
        _rebind(dict([(clip, recorded_clip), *pairs]))
        sys.stdout = watch.PrintTee(sys.stdout, self._printed)
        import atexit
        atexit.register(self._exit)

    def _printed(self, line: str) -> None:
        """A line rank 0 printed: after an evaluation since the last step (its metric), and
        whether random numbers were drawn since that step (then no exact number to compare)."""
        self._write({"event": "print", "text": line, "step": self.step,
                     "eval": self._eval is not None or self._evals > self._evals_at_step,
                     "random": self._unseen_draws or
                     not watch.same(self._rng_at_step, watch.rng()),
                     "model": watch.param_sums(self._models)})

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
        # nn.LSTM/GRU/RNN(dropout=) between their layers: the same masks-by-split reason
        recurrent = [m for m in module.modules() if isinstance(m, nn.RNNBase) and m.dropout > 0]
        for m in recurrent:
            m.dropout = 0.0
        attention = watch.quiet_attention(module, self._sdpa_off)
        norms = [type(m).__name__ for m in module.modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and not isinstance(m, nn.SyncBatchNorm)]
        module.register_forward_pre_hook(_Hook(self, "_before_forward"), with_kwargs=True)
        module.register_forward_hook(_Hook(self, "_after_forward"))
        self._models.append(module)
        self._write({"event": "model", "type": type(module).__name__, "dropouts_off":
                     len(dropouts) + len(recurrent), "attention_dropouts_off": attention,
                     "batchnorms": len(norms)})

    def own_directory(self, path: Any) -> str:
        """``path`` (a checkpoint directory the script names) as this run's own
        (``ddpkit.base.observe.own_directory``): a relative one already lies in the run's working
        directory (where the script also writes beside it, a ``model_best.pt``), except where
        it goes through the link to a directory of the user's, which an empty one replaces; an
        absolute one (or one above) moves into the run's directory. Every rank maps it alike."""
        text = os.fspath(path)
        parts = os.path.normpath(text).split(os.sep)
        cwd = os.path.join(self.directory, "cwd")
        here = os.path.realpath(os.getcwd()) == os.path.realpath(cwd)
        if not os.path.isabs(text) and parts[0] != ".." and here:
            link = os.path.join(cwd, parts[0])
            if parts[0] not in ("", ".") and os.path.islink(link):
                with contextlib.suppress(FileNotFoundError):  # another rank was first
                    os.unlink(link)
                os.makedirs(link, exist_ok=True)
            return text
        name = os.path.abspath(text).strip(os.sep).replace(os.sep, "_") or "root"
        self._write({"event": "own_directory", "path": text})
        return os.path.join(self.directory, "checkpoints", name)

    def _sdpa_off(self) -> None:
        if not getattr(self, "_said_sdpa", False):
            self._said_sdpa = True
            self._write({"event": "sdpa_dropout_off"})

    # ------------------------------------------------------------------ hooks
    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        first = watch.first_tensor((args, kwargs or {}))
        training = module.training and torch.is_grad_enabled()
        # a training batch's samples lie along its dimension of rt.loader's batch size
        rows = watch.row_digests(first, self._batch_samples if training else None)
        if not training:  # an evaluation
            if id(module) in self._trained:
                self._eval = (self._eval or []) + rows
            self._forward_rng[id(module)] = None  # draws in an evaluation are not training's
            if not watch.same(self._rng_at_step, watch.rng()):  # its data drew (augmentation)
                self._unseen_draws = True
            return
        self._end_evaluation()
        self._trained_on_batch()
        self._trained.add(id(module))
        if self._stepped_since_forward and self.step == 0:  # the model as training starts
            param = next(module.parameters(), None)
            self._write({"event": "state", "step": 1, "digests":
                         watch.state_digests(self._models),
                         "device": param.device.type if param is not None else "cpu"})
        self._stepped_since_forward = False
        self._rows.extend(rows)
        self._counts["forwards"] += 1
        self._counts["rows"] += len(rows)
        began = self._forward_rng[id(module)] = watch.rng()
        if self._after_batch is not None and not watch.same(self._after_batch, began):
            self._random_loop = True      # noise, mixup, a random crop in the loop itself
        self._after_batch = None
        dtype = watch.autocast_dtype()
        if dtype is not None and dtype not in self._dtypes:
            self._dtypes.add(dtype)
            self._write({"event": "autocast", "dtype": dtype})

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        before = self._forward_rng.get(id(module))
        if before is not None and not watch.same(before, watch.rng()):
            self._random_forward = True

    def _end_evaluation(self) -> None:
        if self._eval is not None:
            self._write({"event": "eval", "index": self._evals, "step": self.step,
                         "rows": self._eval})
            self._eval, self._evals = None, self._evals + 1

    def _gradients(self) -> Dict[int, str]:
        """The parameters' gradient tensors by id: a collective on one of them is the script
        reducing gradients itself."""
        return {id(p.grad): name for m in self._models for name, p in m.named_parameters()
                if p.grad is not None}

    def _collective(self, event: Dict[str, Any]) -> None:
        self._write({**event, "step": self.step, "phase": "eval" if self._eval is not None
                     else "train"})

    def _trains(self, optimizer: torch.optim.Optimizer) -> bool:
        """Does ``optimizer`` update a model the script wrapped (rt.wrap)? Only its steps
        are the training compared; another's (a model pretrained before rt.wrap, on rank 0
        alone, say) are the script's own business, counted on no rank."""
        models, known = self._training.get(id(optimizer), (-1, False))
        if models != len(self._models):  # asked again only once another model is wrapped
            wrapped = {id(p) for module in self._models for p in module.parameters()}
            known = any(id(p) in wrapped for g in optimizer.param_groups for p in g["params"])
            self._training[id(optimizer)] = (len(self._models), known)
        return known

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._trains(optimizer):
            return
        self._end_evaluation()
        if self._hold is not None:
            self._hold.check(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = self._clipped if self._clipped is not None else \
            watch.norm(p.grad for p in params if p.grad is not None)  # clipping measured it
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
        if not self._trains(optimizer):
            return
        self.step += 1
        self._evals_at_step, self._rng_at_step = self._evals, watch.rng()
        self._unseen_draws = False
        self._stepped_since_forward = True
        if self.step <= self.steps or self._stop_at is not None:  # the steps, then after eval
            params = [p.detach() for group in optimizer.param_groups for p in group["params"]]
            self._write({"event": "step", "step": self.step, "samples": self._indices,
                         "after_eval": self.step > self.steps,
                         "rng": watch.rng_digest(self._rng_at_step),
                         "losses": self._losses,
                         "lr": watch.number(optimizer.param_groups[0].get("lr")),
                         "random_forward": self._random_forward,
                         "random_loop": self._random_loop,
                         "param_sums": [float(p.sum(dtype=torch.float64)) for p in params],
                         "param_norm": watch.norm(params), "rows": self._rows,
                         "loss_counts": self._loss_counts, **self._grad,
                         # the replica invariant: compared between this run's ranks
                         **({"replica": watch.replica_digests(self._models, optimizer)}
                            if self.world_size > 1 else {})})
        self._indices, self._losses, self._clipped, self._rows = [], [], None, []
        self._loss_counts = []
        self._random_forward = self._random_loop = False
        if self.step >= self.steps and self._stop_at is None:
            if self.step >= self.steps + self.eval_within:
                self._stop_at = self.step
            elif watch.any_rank(self._evals, optimizer, self.world_size):  # what it left
                self._stop_at = self.step + AFTER_EVAL
        if self._stop_at is not None and self.step >= self._stop_at:
            self._finish()

    def _exit(self) -> None:
        """The script ended by itself: what it did without an optimizer step counts too."""
        if self._out.closed:
            return
        self._end_evaluation()
        self._write({"event": "exit", "step": self.step, **self._counts})
        self._out.close()

    def _finish(self) -> None:
        """Enough steps: end this rank now, as every rank does after the same step."""
        self._end_evaluation()
        self._write({"event": "exit", "step": self.step, **self._counts})
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


def _divided(tensors: Any, grads: Any, k: int) -> Any:
    """``backward``'s gradient arguments for ``tensors`` divided by ``k``."""
    if grads is None:
        return torch.full_like(tensors, 1.0 / k) if torch.is_tensor(tensors) and \
            tensors.numel() == 1 else None
    if torch.is_tensor(grads):
        return grads / k
    return type(grads)(None if g is None else g / k for g in grads)
