"""The ``dp`` engine: ``nn.DataParallel``, one process driving every visible GPU.

Kept as the tutorials' baseline (it is slower than DDP); on CPU the plain module is used.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import DataParallel

from ..env.detect import ClusterEnv
from ..base.errors import ConfigError
from ..base.wrap import WrapOptions
from .torchdist import TorchEngine

__all__ = ["DPEngine"]


class DPEngine(TorchEngine):
    """Scatter each batch over the GPUs of this process, gather the outputs, reduce in backward.

    Example::

        model = DPEngine().wrap(Net(), env, torch.device("cuda", 0), WrapOptions())
    """

    name = "dp"

    def check_world(self, world_size: int) -> None:
        if world_size > 1:
            raise ConfigError("engine 'dp' runs one process over all GPUs; use --nproc 1")

    def wrap(self, model: nn.Module, env: ClusterEnv, device: torch.device,
             options: WrapOptions) -> nn.Module:
        model = model.to(device)
        if device.type != "cuda" or torch.cuda.device_count() < 1:
            warnings.warn("engine 'dp' needs CUDA devices; on CPU the plain module is used")
            return model
        return DataParallel(model)
