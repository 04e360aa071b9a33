"""Is this ``TrainConfig`` possible here? One clear line for each impossible request, checked in
the launching process before any worker starts (and again on every rank).
"""
from __future__ import annotations

import importlib.util
import os

import torch

from ..data import per_rank_batch_size
from ..engines import create as create_engine
from ..errors import ConfigError
from ..wrap import WrapOptions, check_compile
from .config import TrainConfig
from .datasets import ON_DISK, available_datasets, dataset_key
from .disk_datasets import require_pil
from .models import LANGUAGE_MODELS, available_models, is_torchvision, model_key

__all__ = ["check_config", "micro_batch_size", "check_batch_fits", "known_train_size"]


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
    if model_key(cfg.model) not in available_models() and not is_torchvision(cfg.model):
        raise ConfigError(f"unknown model {cfg.model!r}; valid models: "
                          f"{', '.join(available_models())}, or torchvision:NAME")
    key = dataset_key(cfg.data)
    if key not in available_datasets():
        raise ConfigError(f"unknown dataset {cfg.data!r}; valid datasets: "
                          f"{', '.join(available_datasets())}")
    if key in ON_DISK and (not cfg.data_dir or not os.path.isdir(cfg.data_dir)):
        raise ConfigError(f"dataset {cfg.data!r} needs an existing --data-dir (got "
                          f"{cfg.data_dir!r}); nothing is downloaded")
    language = model_key(cfg.model) in LANGUAGE_MODELS
    if language != (key == "text"):
        raise ConfigError(f"model {cfg.model!r} takes token sequences, use --data text" if language
                          else f"--data text needs a language model: use --model "
                               f"{LANGUAGE_MODELS[0]} (model {cfg.model!r} takes images)")
    if cfg.context < 1:
        raise ConfigError(f"--context must be >= 1, got {cfg.context}")
    # Optional packages the request needs: named here, before any worker starts.
    if key == "imagefolder":
        require_pil()
    if is_torchvision(cfg.model) and importlib.util.find_spec("torchvision") is None:
        raise ConfigError(f"model {cfg.model!r} needs torchvision; pip install torchvision, or "
                          f"use one of {', '.join(available_models())}")
    engine = create_engine(cfg.strategy)
    engine.check_world(world_size)
    reason = engine.unavailable()
    if reason:
        raise ConfigError(f"--strategy {cfg.strategy}: {reason}")
    engine.check_options(WrapOptions(sync_bn=cfg.sync_bn, comm_hook=cfg.comm_hook))
    if cfg.sync_bn and world_size > 1 and not cuda:
        raise ConfigError("--sync-bn needs GPUs: PyTorch's SyncBatchNorm refuses CPU tensors; "
                          "drop --sync-bn when training on CPU")
    if cfg.precision == "fp16" and not cuda:
        raise ConfigError("--precision fp16 needs a CUDA device; use --precision bf16 on CPU")
    if cfg.device_data == "on" and key == "imagefolder":
        raise ConfigError("--device-data on needs an in-memory dataset (digits, cifar10, "
                          "cifar100, synthetic); imagefolder is read file by file: use "
                          "--device-data off or auto")
    if cfg.compile:
        check_compile(torch.device("cuda" if cuda and cfg.accelerator != "cpu" else "cpu"))
    if cfg.epochs < 1:
        raise ConfigError(f"--epochs must be >= 1, got {cfg.epochs}")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.resume not in (None, "", "auto") and not os.path.exists(cfg.resume):
        raise ConfigError(f"--resume {cfg.resume!r} does not exist; give a checkpoint file, a "
                          "directory of checkpoints, or 'auto'")
    micro_batch_size(cfg, world_size)


def known_train_size(cfg: TrainConfig) -> int | None:
    """Training samples of ``cfg``'s dataset when that is cheap to know before launching (the
    embedded digits, synthetic data), else None (read from disk by the workers).

    Example::

        known_train_size(TrainConfig(data="digits"))   # 1438
    """
    key = dataset_key(cfg.data)
    if key == "synthetic":
        return cfg.synthetic_samples
    if key in ("digits", "text"):
        from .datasets import build_dataset
        extra = {"context": cfg.context} if key == "text" else {}
        return len(build_dataset(key, cfg.data_dir, train=True, **extra))
    return None


def check_batch_fits(cfg: TrainConfig, samples: int) -> None:
    """One line if the global batch is larger than the training set.

    Example::

        check_batch_fits(TrainConfig(batch_size=4096), samples=1438)   # ConfigError
    """
    if cfg.batch_size > samples:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the {samples} training "
                          f"samples of {cfg.data!r}: an epoch would be less than one full batch; "
                          f"use --batch-size {samples} or less")
