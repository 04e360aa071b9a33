"""``ddpkit ckpt``: work with checkpoints. ``consolidate`` turns a sharded (FSDP) checkpoint into
one plain ``state_dict`` file, for inference or a DDP run."""
from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit ckpt``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("ckpt", help="checkpoint tools (consolidate FSDP shards)",
                       description="Checkpoint tools.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = actions.add_parser("consolidate", help="one plain state_dict file from a sharded "
                                               "checkpoint",
                           description="Write the model of a sharded (--engine fsdp) "
                                       "checkpoint as one plain state_dict file: "
                                       "model.load_state_dict(torch.load(OUT)).")
    c.add_argument("checkpoint", help="ckpt-*.pt of an FSDP run (or its .shards directory)")
    c.add_argument("out", help="file to write")
    c.set_defaults(func=_cmd_consolidate)


def _cmd_consolidate(ns: argparse.Namespace) -> int:
    from ..checkpoint.sharded import consolidate

    path = consolidate(ns.checkpoint, ns.out)
    print(f"wrote {path}: the model's full state_dict (load it with "
          "model.load_state_dict(torch.load(path)))")
    return 0
