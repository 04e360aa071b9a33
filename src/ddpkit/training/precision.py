"""Precision policies ``fp32 | bf16 | fp16``: autocast for the forward, GradScaler for fp16.

Native ``torch.autocast`` + ``GradScaler`` replace the tutorials' NVIDIA apex AMP.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager, Dict, Optional

import torch

from ..base.errors import ConfigError

__all__ = ["POLICIES", "Precision", "gpu_math"]

POLICIES = ("fp32", "bf16", "fp16")


class Precision:
    """One precision policy on one device: forward context, backward, optimizer step, state.

    Example::

        prec = Precision("bf16", torch.device("cpu"))
        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)
        prec.step(optimizer, clip_norm=1.0, parameters=model.parameters())
    """

    def __init__(self, policy: str = "fp32", device: torch.device = torch.device("cpu")) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"unknown precision {policy!r}; choose one of {', '.join(POLICIES)}")
        if policy == "fp16" and device.type != "cuda":
            raise ConfigError("fp16 mixed precision needs a CUDA device (CPU autocast has no "
                              "fp16 GradScaler path); use --precision bf16 on CPU")
        if policy == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("this GPU does not support bf16; use --precision fp16")
        if policy == "bf16" and device.type == "cpu":
            _warn_if_bf16_emulated()
        self.policy, self.device = policy, device
        self.scaler: Optional[torch.amp.GradScaler] = (
            torch.amp.GradScaler("cuda") if policy == "fp16" else None)

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The autocast dtype, or None for fp32."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.policy)

    def autocast(self) -> ContextManager[Any]:
        """Context for the forward pass and loss (a no-op for fp32).

        Example::

            with prec.autocast():
                out = model(x)
        """
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled first under fp16 so small gradients survive.

        Example::

            prec.backward(loss / accum_steps)
        """
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip_norm: Optional[float] = None,
             parameters: Any = None) -> Optional[float]:
        """Unscale (fp16), clip, step and update the scale; returns the gradient norm if clipped.

        Under fp16 a step with inf/NaN gradients is skipped by the scaler, as it must be.

        Example::

            grad_norm = prec.step(optimizer, clip_norm=1.0, parameters=model.parameters())
        """
        norm = None
        if clip_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
            params = parameters if parameters is not None else [
                p for g in optimizer.param_groups for p in g["params"]]
            total = torch.nn.utils.clip_grad_norm_(params, clip_norm)
            # FSDP's gradients are shards (DTensors): the norm already spans every shard.
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return norm

    def state_dict(self) -> Dict[str, Any]:
        """Policy and GradScaler state, for checkpoints.

        Example::

            ckpt["precision"] = prec.state_dict()
        """
        return {"policy": self.policy,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the GradScaler state; the policy must match.

        Example::

            prec.load_state_dict(ckpt["precision"])
        """
        if state.get("policy") != self.policy:
            raise ConfigError(f"checkpoint was trained with precision {state.get('policy')}, "
                              f"this run uses {self.policy}; pass --precision {state.get('policy')}")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def _warn_if_bf16_emulated() -> None:
    from ..env.machine import cpu_info, native_bf16

    flags = cpu_info()["flags"]
    if flags and not native_bf16(flags):
        warnings.warn("bf16 on this CPU is emulated (no avx512_bf16/amx_bf16 flag): expect it to "
                      "run several times SLOWER than fp32 here; use --precision fp32 (with "
                      "--channels-last) on this machine", stacklevel=3)


def gpu_math(device: torch.device, *, tf32: bool = True, deterministic: bool = False) -> None:
    """Fast GPU defaults for training: TF32 matmuls and convolutions, cuDNN autotuning; both off
    under ``deterministic`` (bitwise-reproducible runs). Does nothing on the CPU.

    Example::

        gpu_math(rt.device)                        # what `ddpkit train` does on a GPU
        gpu_math(rt.device, deterministic=True)    # exact runs: full fp32, no autotuning
    """
    if device.type != "cuda":
        return
    fast = tf32 and not deterministic
    torch.backends.cuda.matmul.allow_tf32 = fast
    torch.backends.cudnn.allow_tf32 = fast
    torch.backends.cudnn.benchmark = not deterministic
