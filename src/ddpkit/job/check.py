"""Is this ``TrainConfig`` possible here? One clear line for each impossible request, checked in
the launching process before any worker starts (and again on every rank).
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import Optional

import torch

from ..checkpoint.compat import named_model_differs
from ..checkpoint.files import holds_run, resolve_resume
from ..data.batch import Spelling, good_sizes, split_batch
from ..engines import create as create_engine
from ..base.errors import ConfigError
from ..base.wrap import WrapOptions, check_compile
from .config import TrainConfig, check_ranges
from .datasets import ON_DISK, available_datasets, dataset_key
from .disk_datasets import require_pil
from .models import LANGUAGE_MODELS, available_models, is_torchvision, model_key

__all__ = ["check_config", "check_every_world", "micro_batch_size", "check_batch_fits", "describe_foreign",
           "known_train_size", "check_resume"]


#: The batch rule's numbers as `ddpkit train` takes them (no per-rank batch flag: the global one
#: is the job's, on any number of processes).
CLI = Spelling("--batch-size", "--accum-steps", None, " ")


def micro_batch_size(cfg: TrainConfig, world_size: int, samples: Optional[int] = None) -> int:
    """Per-rank batch of one micro-step: the global batch / (processes x accumulation steps),
    by the one rule (:func:`ddpkit.data.batch.split_batch`); the job also wants every rank a
    sample each micro-step and an epoch of at least one full batch. One line, with sizes that
    work for these numbers, when there is none.

    Example::

        micro_batch_size(TrainConfig(batch_size=256, accum_steps=2), world_size=4)   # 32
    """
    unit = world_size * cfg.accum_steps  # every micro-step gives each rank at least one sample
    if samples is not None and 0 < unit and samples < unit:  # (split_batch refuses unit < 1)
        split = f"{world_size} processes" + (f" x {cfg.accum_steps} accumulation steps"
                                             if cfg.accum_steps > 1 else "")
        more = (f"--synthetic-samples {unit} or more" if dataset_key(cfg.data) == "synthetic"
                else "a larger dataset")
        most = samples // cfg.accum_steps
        fewer = (f"--nproc {most}{' or less' if most > 1 else ''}" if most
                 else f"--nproc 1 --accum-steps {samples}")
        raise ConfigError(f"the {samples} training sample{'s' if samples != 1 else ''} of "
                          f"{cfg.data!r} cannot give each of "
                          f"{split} a sample: use {more}, or {fewer}")
    micro = split_batch(cfg.batch_size, world_size, cfg.accum_steps, CLI, most=samples)
    if samples is not None and cfg.batch_size > samples:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the {samples} training "
                          f"samples of {cfg.data!r}: an epoch would be less than one full "
                          f"batch; use --batch-size {good_sizes(cfg.batch_size, unit, samples)}")
    return micro


def check_every_world(cfg: TrainConfig, nproc: int, least: int, most: int,
                      samples: Optional[int] = None) -> None:
    """An elastic job (``--nnodes LEAST:MOST``) keeps its global batch on every node count it
    may run on: one line naming the first node count that cannot split it, with sizes that
    every count can.

    Example::

        check_every_world(TrainConfig(batch_size=8), nproc=1, least=2, most=3)   # ConfigError
    """
    unit = math.lcm(*(nodes * nproc * cfg.accum_steps for nodes in range(least, most + 1)))
    for nodes in range(least, most + 1):
        try:
            micro_batch_size(cfg, nodes * nproc, samples)
        except ConfigError as exc:
            where = f"--nnodes {least}:{most}: on {nodes} node{'s' if nodes > 1 else ''}"
            sizes = good_sizes(cfg.batch_size, unit, samples)
            if "cannot be split" not in str(exc):  # too few samples: the line says what to do
                raise ConfigError(f"{where} {exc}") from None
            fix = (f"use a --batch-size every node count splits: {sizes}" if sizes else
                   "no batch size fits every node count with this data: narrow the range")
            raise ConfigError(f"{where} {str(exc).split(';')[0]}; {fix}") from None


def check_config(cfg: TrainConfig, world_size: int, cuda: bool,
                 samples: Optional[int] = None) -> None:
    """Reject impossible configurations with one clear line, before launching anything.

    Example::

        check_config(TrainConfig(model="resnet18"), world_size=2, cuda=False)
    """
    check_ranges(cfg)  # a TrainConfig made in Python never went through config_from_dict
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
    # Optional packages the request needs: named here, before any worker starts.
    if key == "imagefolder":
        require_pil()
    if is_torchvision(cfg.model) and importlib.util.find_spec("torchvision") is None:
        raise ConfigError(f"model {cfg.model!r} needs torchvision; pip install torchvision, or "
                          f"use one of {', '.join(available_models())}")
    engine = create_engine(cfg.engine)
    engine.check_world(world_size)
    reason = engine.unavailable()
    if reason:
        raise ConfigError(f"--engine {cfg.engine}: {reason}")
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
    if cfg.resume not in (None, "", "auto") and not os.path.exists(cfg.resume):
        raise ConfigError(f"--resume {cfg.resume!r} does not exist; give a checkpoint file, a "
                          "directory of checkpoints, or 'auto'")
    if cfg.eval_only:
        _check_eval_only(cfg)
    else:  # an evaluation makes no training loader: its batch need not split
        micro_batch_size(cfg, world_size, samples)


def _check_eval_only(cfg: TrainConfig) -> None:
    """``--eval-only`` evaluates a checkpoint: it needs ``--resume`` and trains nothing.

    Example::

        _check_eval_only(TrainConfig(eval_only=True))   # ConfigError: give --resume
    """
    if not cfg.resume:
        raise ConfigError("--eval-only evaluates a checkpoint: give --resume PATH (a checkpoint "
                          "file or a checkpoints directory), or --resume auto with the run's "
                          "--output")


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


def check_batch_fits(cfg: TrainConfig, samples: int, world_size: int = 1) -> None:
    """One line if no batch of ``cfg`` fits ``samples`` training samples on ``world_size``
    processes (larger than the data, or fewer samples than processes), with sizes that fit.

    Example::

        check_batch_fits(TrainConfig(batch_size=4096), samples=1438)   # ConfigError
    """
    micro_batch_size(cfg, world_size, samples)


# The keys that decide what a checkpoint's weights and data position mean (the seed: the order
# the data is shuffled in, so where in it the checkpoint stands).
_RUN_KEYS = ("model", "data", "context", "seed")
# Keys whose change on resume is no change to the run's course: not worth a note.
_QUIET_KEYS = ("resume", "output", "progress", "nproc", "eval_only")


def describe_foreign(state: object) -> str:
    """What a loaded file that is not a ddpkit checkpoint holds, in a few words.

    Example::

        describe_foreign(nn.Linear(2, 2).state_dict())
        # "a plain state_dict: 2 tensors ('weight', 'bias')"
    """
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a dict"
    keys = list(state)
    names = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
    if keys and all(isinstance(v, torch.Tensor) for v in state.values()):
        return f"a plain state_dict: {len(keys)} tensors ({names})"
    return f"a dict of {len(keys)} key(s): {names}" if keys else "an empty dict"


def check_resume(cfg: TrainConfig) -> None:
    """One line, before anything is written, when ``cfg.resume`` points at a checkpoint of
    another run (another model or dataset): resuming it would fail on every rank after the
    run directory's config had already been replaced.

    Example::

        check_resume(TrainConfig(model="small_cnn", resume="auto", output="runs/resnet"))
    """
    if not cfg.resume:
        return
    # quiet: torn checkpoints and another model's are skipped (and said) by the workers (which
    # judge by the model's name too, and by the weights' names and shapes)
    found = resolve_resume(cfg.resume, os.path.join(cfg.output, "checkpoints"), quiet=True,
                           fits=lambda state: named_model_differs(state, {"model": cfg.model}))
    if cfg.eval_only and not found:
        raise ConfigError(f"--eval-only --resume {cfg.resume}: no checkpoint in "
                          f"{os.path.join(cfg.output, 'checkpoints')} to evaluate; give a "
                          "checkpoint file or the --output of a run that saved one")
    if found and not holds_run(found[1]):
        raise ConfigError(f"--resume {cfg.resume}: {found[0]} is not a checkpoint of ddpkit "
                          f"train ({describe_foreign(found[1])}); --resume continues a run from "
                          "its own checkpoints (runs/NAME/checkpoints/ckpt-*.pt). Nothing was "
                          "written; leave --resume out to start afresh")
    saved = (found[1].get("config") or {}) if found else {}
    if not isinstance(saved, dict):
        return
    keys = [k for k in _RUN_KEYS if not (cfg.eval_only and k == "seed")]  # the data's order
    differ = [k for k in keys if k in saved and saved[k] != getattr(cfg, k)]
    if differ:
        theirs = " ".join(f"--{k} {saved[k]}" for k in differ)
        ours = " ".join(f"--{k} {getattr(cfg, k)}" for k in differ)
        raise ConfigError(f"--resume {cfg.resume}: checkpoint {found[0]} was written with "
                          f"{theirs}, but this run asks for {ours}; resume with {theirs} (or "
                          f"--config of that run), or start this one in another --output")
    changed = [(k, saved[k], getattr(cfg, k)) for k in sorted(saved)
               if hasattr(cfg, k) and k not in _QUIET_KEYS and saved[k] != getattr(cfg, k)]
    if changed and not cfg.eval_only:  # allowed (a longer run, another lr), but not silently
        said = ", ".join(f"{k} {old} -> {new}" for k, old, new in changed)
        print(f"note: resuming {found[0].name} with changes from the run that wrote it: {said}",
              file=sys.stderr, flush=True)
