"""The main job: build data, model, optimizer and schedule from a ``TrainConfig`` and ``fit``.

``train(cfg)`` runs on every rank (``ddpkit train`` launches it with ``python -m ddpkit.train``);
``check_config(cfg)`` catches bad input in the launching process, before any worker starts.
"""
from __future__ import annotations

import json
import math
import os
import sys
from datetime import timedelta
from typing import Any, Dict, Tuple

import torch
from torch import nn

from . import comm
from .config import TrainConfig, config_from_dict
from .data import per_rank_batch_size
from .datasets import available_datasets, build_dataset
from .errors import ConfigError
from .log import RunLogger, banner
from .loop import CheckpointPolicy, TrainState, fit
from .models import available_models, build_model, model_summary
from .precision import Precision
from .runtime import Runtime, setup
from .seed import seed_everything

__all__ = ["train", "check_config", "micro_batch_size"]

_ON_DISK = ("cifar10", "cifar100", "imagefolder")


def micro_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Per-rank batch of one micro-step: the global batch / (processes x accumulation steps).

    Example::

        micro_batch_size(TrainConfig(batch_size=256, accum_steps=2), world_size=4)   # 32
    """
    if cfg.accum_steps < 1:
        raise ConfigError(f"--accum-steps must be >= 1, got {cfg.accum_steps}")
    per_rank = per_rank_batch_size(cfg.batch_size, world_size)
    if per_rank % cfg.accum_steps:
        raise ConfigError(f"--accum-steps {cfg.accum_steps} cannot split the per-process batch "
                          f"{per_rank} (global {cfg.batch_size} / {world_size} processes); "
                          "choose a divisor of it")
    return per_rank // cfg.accum_steps


def check_config(cfg: TrainConfig, world_size: int, cuda: bool) -> None:
    """Reject impossible configurations with one clear line, before launching anything.

    Example::

        check_config(TrainConfig(model="resnet18"), world_size=2, cuda=False)
    """
    name = cfg.model.lower().replace("-", "_")
    if name not in available_models() and not name.startswith("torchvision:"):
        raise ConfigError(f"unknown model {cfg.model!r}; valid models: "
                          f"{', '.join(available_models())}, or torchvision:NAME")
    key = cfg.data.lower().replace("-", "").replace("_", "")
    if key not in available_datasets():
        raise ConfigError(f"unknown dataset {cfg.data!r}; valid datasets: "
                          f"{', '.join(available_datasets())}")
    if key in _ON_DISK and (not cfg.data_dir or not os.path.isdir(cfg.data_dir)):
        raise ConfigError(f"dataset {cfg.data!r} needs an existing --data-dir (got "
                          f"{cfg.data_dir!r}); nothing is downloaded")
    if cfg.strategy == "dp" and world_size > 1:
        raise ConfigError("strategy 'dp' runs one process over all GPUs; use --nproc 1")
    if cfg.strategy == "horovod":
        from . import horovod_engine
        reason = horovod_engine.missing_reason()
        if reason:
            raise ConfigError(f"--strategy horovod: {reason}")
        horovod_engine.check_options({"comm_hook": cfg.comm_hook, "sync_bn": cfg.sync_bn})
    if cfg.sync_bn and world_size > 1 and not cuda:
        raise ConfigError("--sync-bn needs GPUs: PyTorch's SyncBatchNorm refuses CPU tensors; "
                          "drop --sync-bn when training on CPU")
    if cfg.precision == "fp16" and not cuda:
        raise ConfigError("--precision fp16 needs a CUDA device; use --precision bf16 on CPU")
    if cfg.epochs < 1:
        raise ConfigError(f"--epochs must be >= 1, got {cfg.epochs}")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.resume not in (None, "", "auto") and not os.path.exists(cfg.resume):
        raise ConfigError(f"--resume {cfg.resume!r} does not exist; give a checkpoint file, a "
                          "directory of checkpoints, or 'auto'")
    micro_batch_size(cfg, world_size)


def _datasets(cfg: TrainConfig) -> Tuple[Any, Any]:
    key = cfg.data.lower().replace("-", "").replace("_", "")
    kw: Dict[str, Any] = {}
    if key in ("cifar10", "cifar100"):
        kw = {"augment": cfg.augment}
    elif key == "imagefolder":
        kw = {"augment": cfg.augment, "image_size": cfg.image_size}
    elif key == "synthetic":
        kw = {"num_samples": cfg.synthetic_samples, "num_classes": 10}
    test_kw = dict(kw, augment=False) if "augment" in kw else dict(kw)
    if key == "synthetic":
        test_kw["num_samples"] = max(256, cfg.synthetic_samples // 5)
    with comm.main_process_first():  # one rank prepares/caches first; no races on the files
        train_set = build_dataset(cfg.data, cfg.data_dir, train=True, **kw)
        test_set = build_dataset(cfg.data, cfg.data_dir, train=False, **test_kw)
    return train_set, test_set


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, nesterov=cfg.momentum > 0)
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer,
               steps_per_epoch: int) -> Tuple[Any, str]:
    total = cfg.epochs * steps_per_epoch
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total)), "step"
    if cfg.scheduler == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.lr, total_steps=max(1, total)), "step"
    if cfg.scheduler == "step":
        step = max(1, cfg.epochs // 3)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step, gamma=0.1), "epoch"
    return None, "epoch"


def _model(cfg: TrainConfig, rt: Runtime, train_set: Any) -> nn.Module:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, train_set.num_classes, train_set.in_channels)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    comm.print0(model_summary(model))
    return rt.wrap(model, cfg.strategy, sync_bn=cfg.sync_bn, comm_hook=cfg.comm_hook,
                   find_unused_parameters=cfg.find_unused_parameters)


def train(cfg: TrainConfig) -> TrainState:
    """Run one training job on this process (call it on every rank).

    Example::

        state = train(TrainConfig(epochs=2, nproc=1))
        print(state.best)
    """
    rt = setup(backend=cfg.backend, accelerator=cfg.accelerator, seed=cfg.seed,
               timeout=timedelta(seconds=cfg.timeout_s), deterministic=cfg.deterministic,
               engine="horovod" if cfg.strategy == "horovod" else "torch")
    check_config(cfg, rt.world_size, rt.device.type == "cuda")
    banner(rt.env, rt.device, rt.backend)
    train_set, test_set = _datasets(cfg)
    model = _model(cfg, rt, train_set)
    # Weights were initialised identically; from here on each rank gets its own random stream,
    # so augmentation done in the main process (workers=0) differs between ranks.
    seed_everything(cfg.seed, rank_offset=1 + rt.rank)
    micro = micro_batch_size(cfg, rt.world_size)
    loader = rt.loader(train_set, batch_size=cfg.batch_size, per_rank_batch=micro,
                       seed=cfg.seed, num_workers=cfg.workers)
    # Under Horovod: its DistributedOptimizer (fp16 compression = --comm-hook fp16).
    optimizer = rt.optimizer(_optimizer(cfg, model), model, cfg.accum_steps,
                             compression=cfg.comm_hook if cfg.strategy == "horovod" else None)
    scheduler, interval = _scheduler(cfg, optimizer, math.ceil(len(loader) / cfg.accum_steps))
    comm.print0(f"train: {len(train_set)} samples, test: {len(test_set)} samples, "
                f"{len(loader)} micro-batches of {micro} per process per epoch")
    policy = CheckpointPolicy(os.path.join(cfg.output, "checkpoints"), cfg.ckpt_every_steps,
                              cfg.ckpt_every_minutes, cfg.ckpt_every_epoch, cfg.ckpt_keep,
                              cfg.resume)
    state = fit(rt, model, optimizer, loader, epochs=cfg.epochs,
                precision=Precision(cfg.precision, rt.device), accum_steps=cfg.accum_steps,
                clip_norm=cfg.clip_grad, scheduler=scheduler, scheduler_interval=interval,
                eval_data=test_set, eval_every=cfg.eval_every,
                eval_batch_size=cfg.eval_batch_size, logger=RunLogger(cfg.output),
                checkpoint=policy, max_steps=cfg.max_steps, skip_nonfinite=cfg.skip_nonfinite,
                channels_last=cfg.channels_last, log_every=cfg.log_every,
                progress=cfg.progress, config=cfg.to_dict())
    _report(cfg, state)
    rt.shutdown()
    return state


def _report(cfg: TrainConfig, state: TrainState) -> None:
    if not comm.is_main() or not state.history:
        return
    last = state.history[-1]
    summary = {"final": last, "best_top1": state.best, "best_epoch": state.best_epoch,
               "steps": state.step, "epochs": state.epoch}
    with open(os.path.join(cfg.output, "results.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if "eval/top1" in last:
        print(f"final: top-1 {last['eval/top1']:.2f}% on {last['eval/count']} test samples "
              f"(best {state.best:.2f}% at epoch {state.best_epoch}); run dir {cfg.output}",
              flush=True)


def main(argv: Any = None) -> int:
    """Worker entry: ``python -m ddpkit.train RESOLVED_CONFIG.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ddpkit.train CONFIG.json (normally started by `ddpkit train`)",
              file=sys.stderr)
        return 2
    with open(args[0]) as f:
        cfg = config_from_dict(json.load(f))
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
