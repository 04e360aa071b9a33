"""The ``none`` engine: the processes meet over ``torch.distributed`` and the model is left
unwrapped (the script reduces what it needs itself, or trains one process).
"""
from __future__ import annotations

import torch
from torch import nn

from ..env.detect import ClusterEnv
from ..base.wrap import WrapOptions
from .torchdist import TorchEngine

__all__ = ["NoneEngine"]


class NoneEngine(TorchEngine):
    """``setup(engine="none")``: torch.distributed's collectives, the model only moved to the
    device.

    Example::

        engine = ddpkit.engines.create("none")
        model = engine.wrap(Net(), env, torch.device("cpu"), WrapOptions())   # Net on the CPU
    """

    name = "none"

    def wrap(self, model: nn.Module, env: ClusterEnv, device: torch.device,
             options: WrapOptions) -> nn.Module:
        """Move ``model`` to ``device``; nothing else."""
        self.check_options(options)
        return model.to(device)
