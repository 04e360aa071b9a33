"""The Horovod engine: ``strategy="horovod"`` trains through Horovod instead of torch DDP.

Horovod is optional and never a dependency (build it with ``scripts/build_horovod.sh``). When a
process was started by ``horovodrun`` (or ``ddpkit train --strategy horovod``), :func:`ddpkit.setup`
calls :func:`init`: ``hvd.init()`` replaces ``init_process_group``, and ddpkit's rank utilities
(:mod:`ddpkit.comm`: reduce, gather, broadcast, barrier) run on Horovod's collectives, so exact
evaluation, checkpoint agreement and logging work unchanged. Gradients are averaged by
``hvd.DistributedOptimizer`` (:func:`distributed_optimizer`), optionally fp16-compressed, with
parameters and optimizer state broadcast from rank 0; ``hvd.join()`` at the end lets a rank that
ran out of batches serve the others' all-reduces.

Example::

    horovodrun -np 2 --gloo python train.py       # train.py: rt = ddpkit.setup()  (auto-detected)
    ddpkit train --strategy horovod --nproc 2     # the same for the built-in job
"""
from __future__ import annotations

import os
import sys
from typing import Any, List, Mapping, Optional

import torch
from torch import nn

from .env import ClusterEnv
from .errors import ConfigError

__all__ = ["missing_reason", "started_by_horovod", "init", "is_active", "broadcast_model",
           "distributed_optimizer", "launch_args", "run", "check_options"]

_HVD: Any = None          # horovod.torch once init() ran in this process
COMPRESSIONS = ("fp16",)  # comm_hook values Horovod can do (Compression.fp16)


def missing_reason() -> Optional[str]:
    """``None`` when ``horovod.torch`` imports, else why not (one line, with the fix).

    Example::

        if missing_reason(): print("horovod rows skipped:", missing_reason())
    """
    try:
        import horovod.torch  # noqa: F401
    except ImportError as exc:
        return (f"horovod is not installed ({exc}); build it with scripts/build_horovod.sh "
                "or `make horovod`")
    except Exception as exc:  # a broken build raises at import (missing symbol, wrong torch)
        return f"horovod.torch does not import ({type(exc).__name__}: {exc}); rebuild it"
    return None


def started_by_horovod(environ: Mapping[str, str]) -> bool:
    """True in a process launched by ``horovodrun`` (gloo or MPI).

    Example::

        started_by_horovod(os.environ)
    """
    return "HOROVOD_RANK" in environ and "HOROVOD_SIZE" in environ


def is_active() -> bool:
    """True after :func:`init` in this process: collectives go through Horovod.

    Example::

        if is_active(): print("Horovod engine")
    """
    return _HVD is not None


def hvd() -> Any:
    """The initialised ``horovod.torch`` module (raises if :func:`init` has not run)."""
    if _HVD is None:
        raise RuntimeError("the Horovod engine is not initialised; call ddpkit.setup() first")
    return _HVD


def init() -> ClusterEnv:
    """``hvd.init()`` and this process's place in the job, as a :class:`ClusterEnv`.

    Example::

        env = init()     # ClusterEnv(rank=1, world_size=2, launcher='horovod', ...)
    """
    global _HVD
    reason = missing_reason()
    if reason:
        raise ConfigError(reason)
    import horovod.torch as hvd_mod

    hvd_mod.init()
    _HVD = hvd_mod
    return ClusterEnv(rank=hvd_mod.rank(), world_size=hvd_mod.size(),
                      local_rank=hvd_mod.local_rank(), local_world_size=hvd_mod.local_size(),
                      node_rank=hvd_mod.cross_rank(), launcher="horovod")


def shutdown() -> None:
    """Let ranks with fewer batches finish (``hvd.join``), then shut Horovod down."""
    global _HVD
    if _HVD is not None:
        if _HVD.size() > 1:
            _HVD.join()
        _HVD.shutdown()
        _HVD = None


def check_options(strategy_options: Mapping[str, Any]) -> None:
    """Reject DDP-only options under Horovod with one line each.

    Example::

        check_options({"comm_hook": "powersgd"})   # ConfigError
    """
    hook = strategy_options.get("comm_hook")
    if hook is not None and hook not in COMPRESSIONS:
        raise ConfigError(f"comm hook {hook!r} is DDP-only; with strategy 'horovod' use "
                          "--comm-hook fp16 (Horovod's fp16 compression) or none")
    if strategy_options.get("sync_bn"):
        raise ConfigError("--sync-bn is not supported with strategy 'horovod' in ddpkit; use ddp")


def broadcast_model(model: nn.Module) -> nn.Module:
    """Rank 0's parameters and buffers to every rank (Horovod needs no model wrapper).

    Example::

        model = broadcast_model(Net().to(device))
    """
    h = hvd()
    h.broadcast_parameters(model.state_dict(), root_rank=0)
    if h.size() > 1 and not hasattr(model, "_ddpkit_hvd_guard"):
        model._ddpkit_hvd_guard = model.register_forward_pre_hook(_require_optimizer)
    return model


def _require_optimizer(module: nn.Module, args: Any) -> None:
    # Without Horovod's DistributedOptimizer nothing averages the gradients and every rank
    # would silently train its own model: refuse the first training step instead.
    if module.training and not getattr(module, "_ddpkit_hvd_optimizer", False):
        raise ConfigError("under Horovod, pass the optimizer through rt.optimizer(optimizer, "
                          "model) before training (it averages the gradients across ranks)")


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                          accum_steps: int = 1, compression: Optional[str] = None
                          ) -> torch.optim.Optimizer:
    """Wrap in ``hvd.DistributedOptimizer`` and broadcast rank 0's optimizer state.

    ``accum_steps`` becomes ``backward_passes_per_step``: one all-reduce per optimizer step.
    Idempotent: an optimizer wrapped before is returned as it is.

    Example::

        opt = distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                    accum_steps=2, compression="fp16")
    """
    if getattr(optimizer, "_ddpkit_horovod", False):
        return optimizer
    h = hvd()
    comp = h.Compression.fp16 if compression == "fp16" else h.Compression.none
    names = {p: n for n, p in model.named_parameters()}
    named = [(names[p], p) for g in optimizer.param_groups for p in g["params"] if p in names]
    wrapped = h.DistributedOptimizer(optimizer, named_parameters=named or None,
                                     compression=comp, backward_passes_per_step=accum_steps)
    # Horovod's copy shares the param_group dicts (an LR scheduler of the original still
    # drives it) but not the state: carry over anything the original already holds.
    wrapped.load_state_dict(optimizer.state_dict())
    # A fresh optimizer has no state on any rank: nothing to send. (Horovod would otherwise
    # initialise it with a zero-gradient step, which moves weights under weight decay.)
    if h.broadcast_object(len(optimizer.state) > 0, root_rank=0):
        h.broadcast_optimizer_state(wrapped, root_rank=0)
    wrapped._ddpkit_horovod = True
    model._ddpkit_hvd_optimizer = True
    return wrapped


def launch_args(nproc: int, argv: List[str], start_timeout: int = 60) -> List[str]:
    """``horovodrun`` arguments (gloo controller, this host) that run ``argv`` on ``nproc`` ranks.

    Example::

        launch_args(2, ["python", "-m", "ddpkit.train", "cfg.json"])
    """
    return ["-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo",
            "--start-timeout", str(start_timeout), *argv]


def run(nproc: int, argv: List[str], start_timeout: int = 60) -> int:
    """Run ``argv`` under ``horovodrun`` on this host; returns 0, or 1 with one error line.

    Horovod's launcher relays every rank's output prefixed ``[rank]``; its own traceback on a
    failed rank is replaced by one line naming that rank.

    Example::

        run(2, [sys.executable, "-m", "ddpkit.train", "runs/x/config.json"])
    """
    reason = missing_reason()
    if reason:
        raise ConfigError(reason)
    from horovod.runner.launch import _run, parse_args

    os.environ.setdefault("HOROVOD_GLOO_IFACE", "lo")  # one host: loopback, never the LAN
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    saved = sys.argv
    sys.argv = ["horovodrun", *launch_args(nproc, argv, start_timeout)]
    try:
        _run(parse_args())
    except RuntimeError as exc:
        text = " ".join(str(exc).split())
        first = text.split("The first process to do so was:")[-1].strip()
        print(f"error: the Horovod job failed ({first or text}); its output is above",
              file=sys.stderr, flush=True)
        return 1
    finally:
        sys.argv = saved
    return 0
