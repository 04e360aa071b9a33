"""``ddpkit train``: flags generated from :class:`~ddpkit.job.config.TrainConfig`, the shared
launch flags, then :func:`ddpkit.job.start.start` (check, save the config, launch).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict

from ..job.config import RENAMED, TrainConfig, field_type, merge, renamed_note
from .flags import add_launch_flags, add_stall_flag, pass_stall_after, run_config

__all__ = ["add_parser", "resolve"]


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("job (TrainConfig; also settable in --config)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str if "parse" in f.metadata else field_type(f.name)  # parsed by the config
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text,
                               choices=f.metadata.get("choices"), dest=f.name)
    for old, new in RENAMED.items():  # the old spelling still works, with a note
        f = next(f for f in dataclasses.fields(TrainConfig) if f.name == new)
        group.add_argument("--" + old.replace("_", "-"), action=_Renamed, dest=new,
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                           choices=f.metadata.get("choices"))


class _Renamed(argparse.Action):
    """A flag's old name: sets the new one and says so in one line."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any,
                 option_string: Any = None) -> None:
        import sys
        print(renamed_note(option_string.lstrip("-"), self.dest, flag=True), file=sys.stderr,
              flush=True)
        setattr(namespace, self.dest, values)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit train``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("train", help="train a built-in model on a built-in dataset",
                       description="Train a built-in model. With no flags: the small CNN on "
                                   "the embedded digits dataset, one process per GPU (2 on "
                                   "CPU), exact evaluation.")
    p.add_argument("--config", help="YAML or TOML file with TrainConfig keys (flags win)")
    p.add_argument("--overwrite", action="store_true",
                   help="--output holds an earlier run (results.json, checkpoints): delete its "
                        "files first and start afresh (without it such a directory is refused "
                        "unless --resume continues the run)")
    add_stall_flag(p)
    add_launch_flags(p)
    _add_config_flags(p)
    p.set_defaults(func=_cmd_train)


def resolve(ns: argparse.Namespace) -> TrainConfig:
    """Defaults < ``--config`` file < flags given on the command line.

    Example::

        cfg = resolve(build_parser().parse_args(["train", "--epochs", "2"]))
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    flags: Dict[str, Any] = {k: v for k, v in vars(ns).items() if k in names}
    return merge(ns.config, flags)


def _cmd_train(ns: argparse.Namespace) -> int:
    from ..job.start import WORKER, start

    pass_stall_after(ns.stall_after)
    return start(resolve(ns), run_config(ns, WORKER, module=True), overwrite=ns.overwrite)
