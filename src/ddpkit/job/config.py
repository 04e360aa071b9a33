"""``TrainConfig``: everything ``ddpkit train`` does, as one dataclass; from flags and YAML/TOML.

Precedence: dataclass defaults < config file < command-line flags. Unknown keys and wrong types
are rejected with the key named.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

from ..engines import ENGINES
from ..engines.ddp import COMM_HOOKS
from ..base.errors import ConfigError

__all__ = ["TrainConfig", "load_config_file", "merge", "config_from_dict", "field_type",
           "parse_nproc", "check_ranges", "run_directory_of"]


def _opt(default: Any, help: str, choices: Optional[tuple] = None, least: Any = None,
         above: Any = None) -> Any:
    """A field with its help, its choices and its range: ``least`` (>=) or ``above`` (>)."""
    return field(default=default, metadata={"help": help, "choices": choices, "least": least,
                                            "above": above})


@dataclass
class TrainConfig:
    """The resolved configuration of one training run (printed at start, saved in the run dir).

    Example::

        cfg = TrainConfig(model="resnet18", data="synthetic", epochs=1, batch_size=128)
    """

    # launch
    nproc: Union[int, str] = field(default="auto", metadata={
        "help": "processes on this node: a number, or 'auto' (one per GPU; 2 on CPU)",
        "parse": lambda v: parse_nproc(v)})
    engine: str = _opt("ddp", "how the model is replicated (horovod: needs scripts/build_horovod.sh)",
                         ENGINES)
    backend: Optional[str] = _opt(None, "process group backend (default: nccl on GPU, gloo on CPU)")
    accelerator: str = _opt("auto", "device type", ("auto", "cpu", "cuda"))
    timeout_s: float = _opt(600.0, "collective timeout in seconds", above=0)
    # model and data
    model: str = _opt("small_cnn", "built-in model name (gpt: a language model for --data text) "
                                   "or torchvision:NAME")
    data: str = _opt("digits", "dataset name")
    data_dir: Optional[str] = _opt(None, "dataset root for cifar10/cifar100/imagefolder; text: "
                                         "a text file or directory (default: ddpkit's sources)")
    context: int = _opt(128, "text: tokens (bytes) per training sequence", least=1)
    synthetic_samples: int = _opt(2048, "training samples of the synthetic dataset", least=1)
    image_size: int = _opt(32, "image size for imagefolder", least=1)
    augment: bool = _opt(False, "random crop + flip (cifar, imagefolder)")
    workers: int = _opt(0, "data-loader worker processes per rank (unused with device data)",
                       least=0)
    device_data: str = _opt("auto", "keep the data on the GPU and gather batches there (auto: "
                            "when it fits in a quarter of free GPU memory; on: also on CPU)",
                            ("auto", "on", "off"))
    # optimisation
    epochs: int = _opt(12, "training epochs", least=1)
    batch_size: int = _opt(64, "GLOBAL batch size (split across processes)", least=1)
    lr: float = _opt(0.05, "peak learning rate", above=0)
    optimizer: str = _opt("sgd", "optimizer", ("sgd", "adam", "adamw"))
    momentum: float = _opt(0.9, "SGD momentum", least=0)
    weight_decay: float = _opt(5e-4, "weight decay", least=0)
    scheduler: str = _opt("cosine", "LR schedule (cosine and onecycle step per batch)",
                          ("none", "cosine", "step", "onecycle"))
    accum_steps: int = _opt(1, "gradient accumulation micro-steps per optimizer step", least=1)
    clip_grad: Optional[float] = _opt(None, "clip the gradient norm to this value", above=0)
    precision: str = _opt("fp32", "numeric precision", ("fp32", "bf16", "fp16"))
    channels_last: bool = _opt(False, "channels_last memory format for conv nets")
    compile: bool = _opt(False, "torch.compile the model (needs a C++ compiler on CPU, triton "
                                "on GPU)")
    tf32: bool = _opt(True, "GPUs: TF32 matmuls/convolutions and cuDNN autotuning (off under "
                            "--deterministic)")
    sync_bn: bool = _opt(False, "convert BatchNorm to SyncBatchNorm when world size > 1")
    comm_hook: Optional[str] = _opt(None, "gradient compression (horovod: fp16 only)",
                                    COMM_HOOKS)
    powersgd_rank: Optional[int] = _opt(None, "PowerSGD's matrix rank (default: 2 for powersgd, "
                                              "4 for powersgd-batched; auto chooses its own)",
                                        least=1)
    powersgd_start_iter: int = _opt(10, "PowerSGD: plain all-reduce for the first N steps "
                                        "(powersgd, powersgd-batched)", least=2)
    find_unused_parameters: bool = _opt(False, "DDP find_unused_parameters")
    skip_nonfinite: bool = _opt(False, "skip optimizer steps with NaN/inf gradients instead of stopping")
    max_steps: Optional[int] = _opt(None, "stop after this many optimizer steps", least=1)
    # evaluation, logging, reproducibility
    eval_every: int = _opt(1, "evaluate every N epochs (0: only at the end)", least=0)
    eval_batch_size: int = _opt(256, "evaluation batch size per process", least=1)
    seed: int = _opt(0, "random seed", least=0)
    deterministic: bool = _opt(False, "torch.use_deterministic_algorithms")
    output: str = _opt("runs/ddpkit", "run directory (config, metrics.jsonl, checkpoints)")
    log_every: int = _opt(20, "log training metrics every N optimizer steps", least=1)
    log_to: Optional[str] = _opt(None, "trackers besides metrics.jsonl and TensorBoard (when "
                                       "installed): mlflow, wandb, comma-separated (each an "
                                       "extra: pip install 'ddpkit[mlflow]')")
    progress: bool = _opt(True, "progress bar on rank 0 when stderr is a terminal")
    # checkpoints and resume
    resume: Optional[str] = _opt(None, "'auto' (latest valid checkpoint in the run dir) or a path")
    ckpt_every_steps: Union[int, str] = field(default=0, metadata={
        "help": "checkpoint every N optimizer steps (0: off; 'auto': from the measured save "
                "time and --ckpt-mtbf-hours, Young/Daly)", "least": 0,
        "parse": lambda v: parse_every_steps(v)})
    ckpt_every_minutes: float = _opt(0.0, "checkpoint every N minutes (0: off)", least=0)
    ckpt_keep: int = _opt(3, "checkpoints to keep", least=1)
    ckpt_every_epoch: bool = _opt(True, "checkpoint at the end of every epoch")
    ckpt_mtbf_hours: float = _opt(24.0, "expected hours between failures, for --ckpt-every-steps "
                                        "auto", above=0)
    ckpt_async: bool = _opt(False, "write checkpoints in the background (a step waits only "
                                   "for a copy in host memory)")
    eval_only: bool = _opt(False, "evaluate the --resume checkpoint's model on the test set on "
                                  "these processes and stop (trains and writes nothing)")

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict (for JSON/YAML and checkpoints)."""
        return dataclasses.asdict(self)

    def dump(self, path: str) -> None:
        """Write the resolved config as JSON (a valid YAML file too)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=False)
            f.write("\n")


def parse_nproc(value: Any) -> Union[int, str]:
    """``--nproc`` as given: a positive integer, or ``"auto"``; anything else is a ConfigError.

    Example::

        parse_nproc("4"), parse_nproc("auto")   # (4, 'auto')
    """
    return _int_or_auto(value, 1, "--nproc (nproc) must be a positive integer or 'auto'")


def parse_every_steps(value: Any) -> Union[int, str]:
    """``--ckpt-every-steps`` as given: an integer >= 0, or ``"auto"``; else a ConfigError.

    Example::

        parse_every_steps("200"), parse_every_steps("auto")   # (200, 'auto')
    """
    return _int_or_auto(value, 0, "--ckpt-every-steps (ckpt_every_steps) must be an integer "
                                  ">= 0 (0: off) or 'auto'")


def _int_or_auto(value: Any, least: int, rule: str) -> Union[int, str]:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        number = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < least:
        raise ConfigError(f"{rule}, got {value!r}")
    return number


def field_type(name: str) -> Any:
    """The plain type of a :class:`TrainConfig` field (``Optional[int]`` -> ``int``).

    Example::

        field_type("clip_grad")   # float
    """
    hint = typing.get_type_hints(TrainConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _metadata() -> Dict[str, Any]:
    return {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}


def _optional(key: str) -> bool:
    return type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[key])


def _coerce(key: str, value: Any) -> Any:
    parse = _metadata()[key].get("parse")
    if parse is not None:
        return parse(value)
    want = field_type(key)
    if value is None:
        if _optional(key):
            return None
        raise ConfigError(f"config key {key!r} must not be empty (null); give a {want.__name__}")
    if want is float and isinstance(value, str):
        try:  # YAML reads 1e-3 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if want is bool and not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"config key {key!r} must be of type {want.__name__}, got "
                          f"{type(value).__name__} {value!r}")
    return value


#: Keys a run adds to its config.json as a record, read back as nothing: what ``--comm-hook
#: auto`` chose (``comm_hook_chosen``).
RECORDED = ("comm_hook_chosen",)
#: Old names of keys (and flags), still read, with a note: old name -> new name.
RENAMED = {"strategy": "engine"}


def renamed_note(old: str, new: str, flag: bool = False) -> str:
    """The one-line note for a key (or ``--flag``) read under its old name.

    Example::

        renamed_note("strategy", "engine", flag=True)   # 'note: --strategy is now --engine; ...'
    """
    if flag:
        old, new = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
    else:
        old, new = repr(old), repr(new)
    return f"note: {old} is now {new}; the old name still works"


def config_from_dict(values: Mapping[str, Any], base: Optional[TrainConfig] = None) -> TrainConfig:
    """Apply ``values`` over ``base`` (or defaults), checking names, types and choices.

    Example::

        cfg = config_from_dict({"epochs": 3, "model": "resnet18"})
    """
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    clean: Dict[str, Any] = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key in RECORDED:
            continue
        if key in RENAMED and RENAMED[key] not in values:
            print(renamed_note(key, RENAMED[key]), file=sys.stderr, flush=True)
            key = RENAMED[key]
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {raw_key!r}{hint}")
        value = _coerce(key, value)
        choices = fields[key].metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"config key {key!r} must be one of {', '.join(choices)}, got {value!r}")
        clean[key] = value
    cfg = dataclasses.replace(base or TrainConfig(), **clean)
    check_ranges(cfg)
    return cfg


def check_ranges(cfg: TrainConfig) -> None:
    """One line for the first number outside its field's range (``--ckpt-keep 0``, say), so it
    is refused before any process starts, not after an epoch.

    Example::

        check_ranges(TrainConfig(eval_batch_size=0))   # ConfigError: --eval-batch-size ...
    """
    for f in dataclasses.fields(TrainConfig):
        value, least, above = getattr(cfg, f.name), f.metadata.get("least"), f.metadata.get("above")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue  # None (not set) or a parsed value (nproc)
        flag = "--" + f.name.replace("_", "-")
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{flag} must be a finite number, got {value}")
        if least is not None and value < least:
            raise ConfigError(f"{flag} must be >= {least}, got {value} ({f.metadata['help']})")
        if above is not None and value <= above:
            raise ConfigError(f"{flag} must be > {above}, got {value} ({f.metadata['help']})")


def load_config_file(path: str) -> Dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``/``.json``) or TOML (``.toml``) config file into a dict.

    Example::

        values = load_config_file("train.toml")
    """
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = _parse(path, raw)
    except ConfigError:
        raise
    except Exception as exc:  # each parser has its own error type
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"config file {path!r} is malformed: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys to values")
    return data


def _parse(path: str, raw: bytes) -> Any:
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            import tomli as tomllib  # type: ignore[no-redef]
        return tomllib.loads(raw.decode())
    if path.endswith(".json"):
        return json.loads(raw.decode())
    try:
        import yaml
    except ImportError:
        raise ConfigError("reading YAML needs PyYAML: pip install 'ddpkit[config]' "
                          "(or use a .toml file)") from None
    return yaml.safe_load(raw.decode())


def merge(file_path: Optional[str], flags: Mapping[str, Any]) -> TrainConfig:
    """Defaults, then the config file (if any), then the flags the user actually gave.

    Example::

        cfg = merge("train.yaml", {"epochs": 2})
    """
    values = load_config_file(file_path) if file_path else {}
    folder = run_directory_of(file_path) if file_path else None
    if folder is not None and "output" not in flags:
        recorded = values.get("output")
        if recorded is None or os.path.realpath(str(recorded)) != os.path.realpath(folder):
            print(f"note: {file_path} lies in the run directory {folder} (its output says "
                  f"{recorded}): the run was moved or copied, so it resumes from and writes to "
                  f"{folder}", file=sys.stderr, flush=True)
        values = {**values, "output": folder}
    cfg = config_from_dict(values) if file_path else TrainConfig()
    return config_from_dict(flags, cfg)


def run_directory_of(file_path: str) -> Optional[str]:
    """The run directory a ``config.json`` belongs to: the folder it lies in, when that holds a
    run (``checkpoints/`` or ``metrics.jsonl`` beside it), else None. A run directory is
    relocatable: a copy of it resumes from, and writes to, itself.

    Example::

        run_directory_of("runs/demo/config.json")   # 'runs/demo'
    """
    if os.path.basename(file_path) != "config.json":
        return None
    folder = os.path.dirname(file_path) or "."
    if os.path.isdir(os.path.join(folder, "checkpoints")) or \
            os.path.isfile(os.path.join(folder, "metrics.jsonl")):
        return folder
    return None
