"""What ``ddpkit train`` builds from a ``TrainConfig``: datasets, model, optimizer, LR schedule.

Each builder is a plain function of the config (and the runtime where a device is involved).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

from ..engines import comm
from ..training.runtime import Runtime
from .config import TrainConfig
from .datasets import build_dataset, dataset_key
from .models import build_model, model_summary

__all__ = ["build_datasets", "build_optimizer", "build_scheduler", "build_wrapped_model",
           "replicated_model"]


def build_datasets(cfg: TrainConfig) -> Tuple[Any, Any]:
    """(train, test) datasets ``cfg`` names; rank 0 prepares them first, the others after.

    Example::

        train_set, test_set = build_datasets(TrainConfig(data="digits"))
    """
    key = dataset_key(cfg.data)
    kw: Dict[str, Any] = {}
    if key in ("cifar10", "cifar100"):
        kw = {"augment": cfg.augment}
    elif key == "imagefolder":
        kw = {"augment": cfg.augment, "image_size": cfg.image_size}
    elif key == "synthetic":
        kw = {"num_samples": cfg.synthetic_samples, "num_classes": 10}
    elif key == "text":
        kw = {"context": cfg.context}
    test_kw = dict(kw, augment=False) if "augment" in kw else dict(kw)
    if key == "synthetic":
        test_kw["num_samples"] = max(256, cfg.synthetic_samples // 5)
    with comm.main_process_first():  # one rank prepares/caches first; no races on the files
        train_set = build_dataset(cfg.data, cfg.data_dir, train=True, **kw)
        test_set = build_dataset(cfg.data, cfg.data_dir, train=False, **test_kw)
    return train_set, test_set


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD (Nesterov when there is momentum), Adam or AdamW with ``cfg``'s settings.

    Example::

        opt = build_optimizer(TrainConfig(optimizer="adamw", lr=1e-3), model)
    """
    params = model.parameters()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, nesterov=cfg.momentum > 0)
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer,
                    steps_per_epoch: int) -> Tuple[Any, str]:
    """The LR schedule and when it steps (``"step"`` or ``"epoch"``); ``(None, "epoch")`` for none.

    Example::

        scheduler, interval = build_scheduler(cfg, opt, steps_per_epoch=23)
    """
    total = cfg.epochs * steps_per_epoch
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total)), "step"
    if cfg.scheduler == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.lr, total_steps=max(1, total)), "step"
    if cfg.scheduler == "step":
        step = max(1, cfg.epochs // 3)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step, gamma=0.1), "epoch"
    return None, "epoch"


def replicated_model(rt: Runtime, name: str, train_set: Any, seed: int,
                     channels_last: bool = False, summary: bool = False,
                     **wrap_options: Any) -> nn.Module:
    """Built-in model ``name`` for ``train_set``, identical on every rank, wrapped by ``rt``.

    Used by the job and by the bench, so both train the very same replicas.

    Example::

        model = replicated_model(rt, "small_cnn", train_set, seed=0, sync_bn=False)
    """
    torch.manual_seed(seed)  # identical initial weights on every rank
    model = build_model(name, train_set.num_classes, train_set.in_channels,
                        **getattr(train_set, "model_options", {}))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if summary:
        comm.print0(model_summary(model))
    return rt.wrap(model, **wrap_options)


def build_wrapped_model(cfg: TrainConfig, rt: Runtime, train_set: Any) -> nn.Module:
    """The job's model: ``cfg.model``, seeded, summarised on rank 0, wrapped as ``cfg`` says.

    Example::

        model = build_wrapped_model(cfg, rt, train_set)
    """
    return replicated_model(rt, cfg.model, train_set, cfg.seed, cfg.channels_last,
                            summary=not rt.env.restart_count,  # said once, not per restart
                            sync_bn=cfg.sync_bn, comm_hook=cfg.comm_hook,
                            powersgd_rank=cfg.powersgd_rank,
                            powersgd_start_iter=cfg.powersgd_start_iter,
                            find_unused_parameters=cfg.find_unused_parameters,
                            compile=cfg.compile,
                            mixed_precision=cfg.precision if cfg.precision != "fp32" else None)
