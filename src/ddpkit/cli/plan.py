"""``ddpkit plan``: predicted step time, throughput and scaling efficiency per node count and comm
hook, and the recommendation (``ddpkit.plan``)."""
from __future__ import annotations

import argparse
import json
import os

from ..errors import ConfigError

__all__ = ["add_parser", "parse_link"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit plan``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("plan", help="predict step time and scaling per node count and comm hook",
                       description="Predicts a DDP step from the model's gradient buckets, its "
                                   "measured forward+backward and a link (named, or measured by "
                                   "ddpkit doctor --json), for each node count and comm hook.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a built-in model (resnet18, gpt, ...) or torchvision:NAME")
    what.add_argument("--params", type=float, help="a model known by its parameter count")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--compute-ms", type=float,
                   help="forward+backward per rank (default: measured here for --model)")
    p.add_argument("--nodes", default="1,2,4", help="node counts to predict (default 1,2,4)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--link", default="10gbit",
                   help="between nodes: 10mbit, 100mbit, 1gbit, 10gbit, 25gbit, 100gbit, or "
                        "the JSON of ddpkit doctor --json (default 10gbit)")
    p.add_argument("--inside", default="100gbit", help="between ranks of one node (default 100gbit)")
    p.add_argument("--powersgd-rank", type=int, default=None,
                   help="PowerSGD's rank (default: 2 per tensor, 4 batched)")
    p.add_argument("--json", metavar="PATH", help="also write the prediction as JSON to PATH")
    p.set_defaults(func=_cmd_plan)


def parse_link(text: str):  # -> Link
    """A named link, or the measured one in a ``ddpkit doctor --json`` report.

    Example::

        parse_link("1gbit"); parse_link("doctor.json")
    """
    from ..stepcost import LINKS, Link

    if text in LINKS:
        return LINKS[text]
    if os.path.isfile(text):
        try:
            with open(text) as f:
                link = json.load(f)["link"]
            return Link(f"measured ({text})", float(link["alpha"]), float(link["beta"]),
                        float(link.get("overlap", 1.0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--link {text}: not a ddpkit doctor --json report with a "
                              f"measured link ({exc})") from None
    raise ConfigError(f"--link {text!r}: give one of {', '.join(LINKS)} or the JSON file of "
                      "ddpkit doctor --json")


def _nodes(text: str) -> list:
    try:
        nodes = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        nodes = []
    if not nodes or min(nodes) < 1:
        raise ConfigError(f"--nodes {text!r}: give node counts >= 1 separated by commas, e.g. 1,2,4")
    return nodes


def _cmd_plan(ns: argparse.Namespace) -> int:
    from ..costprobe import measure_flops, measure_hook
    from ..plan.predict import HOOKS, model_workload, predict, synthetic_workload
    from ..plan.report import advice, as_json, assumptions, table
    from ..stepcost import DEFAULT_RANKS

    nodes, link, inside = _nodes(ns.nodes), parse_link(ns.link), parse_link(ns.inside)
    for flag, value in (("--batch", ns.batch), ("--gpus-per-node", ns.gpus_per_node),
                        ("--powersgd-rank", ns.powersgd_rank)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    compute = ns.compute_ms / 1e3 if ns.compute_ms is not None else None
    if compute is not None and compute <= 0:
        raise ConfigError(f"--compute-ms must be > 0, got {ns.compute_ms:g}")
    if ns.params is not None:
        if compute is None:
            raise ConfigError("--params needs --compute-ms (forward+backward of one rank's "
                              "batch): without the model there is nothing to measure")
        work = synthetic_workload(int(ns.params), compute, ns.batch)
    else:
        work = model_workload(ns.model, ns.batch, compute)
    flops = measure_flops()
    hooks = {h: measure_hook(work, h, ns.powersgd_rank or DEFAULT_RANKS.get(h, 2)) for h in HOOKS}
    rows = predict(work, nodes, link, ns.gpus_per_node, inside, rank=ns.powersgd_rank,
                   flops_per_s=flops, hook_seconds=hooks)
    print(table(rows))
    for line in advice(rows, ns.powersgd_rank):
        print(line)
    for line in assumptions(work, link, hooks, inside):
        print(f"assumed: {line}")
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(as_json(rows, work, link) + "\n")
    return 0
