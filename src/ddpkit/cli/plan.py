"""``ddpkit plan``: predicted step time, throughput and scaling efficiency per node count and comm
hook, and the recommendation (``ddpkit.plan``)."""
from __future__ import annotations

import argparse
import math
import dataclasses
import json
import os
from typing import Optional

from ..base.errors import ConfigError

__all__ = ["add_parser", "parse_link"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit plan``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("plan", help="predict step time and scaling per node count and comm hook",
                       description="Predicts a DDP step from the model's gradient buckets, its "
                                   "training step timed on this node's ranks as ddpkit train "
                                   "runs them (the job's input, a rank's threads, the median of "
                                   "--repeats) and a link (named, or measured by ddpkit doctor "
                                   "--json), for each node count and comm hook.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", help="a built-in model (resnet18, gpt, ...) or torchvision:NAME "
                                      "(default: ddpkit train's, small_cnn)")
    what.add_argument("--params", type=float, help="a model known by its parameter count")
    p.add_argument("--data", help="the job's dataset, whose samples' shape is timed (default: "
                                  "ddpkit train's, digits; text for a language model)")
    p.add_argument("--data-dir", help="its root, for cifar10/cifar100/imagefolder")
    p.add_argument("--input-shape", help="C,H,W of one image (or the tokens of one sequence) "
                                         "instead of the dataset's")
    p.add_argument("--batch", type=int, default=32,
                   help="samples per rank per step (default 32: ddpkit train's 64 over 2 ranks)")
    p.add_argument("--compute-ms", type=float,
                   help="a training step per rank (default: measured here for --model)")
    p.add_argument("--repeats", type=int, default=7,
                   help="timed steps after 2 warm-up ones, at least; their median is used "
                        "(default 7)")
    p.add_argument("--min-time", type=float, default=0.5, metavar="SECONDS",
                   help="and at least this long of them: a short step is timed more often, up "
                        "to 100 times (default 0.5)")
    p.add_argument("--nodes", default="1,2,4", help="node counts to predict (default 1,2,4)")
    p.add_argument("--nproc", "--gpus-per-node", dest="nproc", default="auto",
                   help="ranks per node, as ddpkit train --nproc: a number, or auto (one per GPU, "
                        "2 on CPU); on CPU each rank is timed with its share of the cores")
    p.add_argument("--host-ranks", type=int, default=None,
                   help="the job's ranks that share this machine's cores, when several of its "
                        "nodes run on one host (containers, VMs, network namespaces): the step "
                        "is timed on that many ranks at once (default: --nproc)")
    p.add_argument("--link", default="10gbit",
                   help="between nodes: 10mbit, 100mbit, 1gbit, 10gbit, 25gbit, 100gbit, or "
                        "the JSON of ddpkit doctor --json (default 10gbit)")
    p.add_argument("--inside", default="100gbit",
                   help="between ranks of one node, as --link (default 100gbit; on CPU ranks "
                        "over loopback give what ddpkit doctor --nproc N --json measures)")
    p.add_argument("--powersgd-rank", type=int, default=None,
                   help="PowerSGD's rank (default: 2 per tensor, 4 batched)")
    p.add_argument("--json", metavar="PATH", help="also write the prediction as JSON to PATH")
    p.set_defaults(func=_cmd_plan)


def parse_link(text: str):  # -> Link
    """A named link, or the measured one in a ``ddpkit doctor --json`` report.

    Example::

        parse_link("1gbit"); parse_link("doctor.json")
    """
    from ..cost.model import LINKS, Link

    if text in LINKS:
        return LINKS[text]
    if os.path.isfile(text):
        try:
            with open(text) as f:
                report = json.load(f)
            link = report["link"]
            sweep = tuple((float(r["bytes"]), float(r["seconds"]))
                          for r in report.get("sweep") or ()
                          if 0 < float(r["seconds"]) < math.inf and float(r["bytes"]) > 0)
            return Link(f"measured ({text})", float(link["alpha"]), float(link["beta"]),
                        float(link.get("overlap", 1.0)), sweep=sweep if len(sweep) >= 2 else (),
                        sweep_ranks=int(link.get("ranks", report.get("ranks", 0)) or 0))
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
    from ..cost.measure import measure_flops
    from ..plan.measure import rank_threads, using_threads
    from ..plan.predict import predict
    from ..plan.report import advice, as_json, assumptions, table

    nodes, link, inside = _nodes(ns.nodes), parse_link(ns.link), parse_link(ns.inside)
    per_node = _per_node(ns.nproc)
    for flag, value in (("--batch", ns.batch), ("--powersgd-rank", ns.powersgd_rank),
                        ("--repeats", ns.repeats), ("--host-ranks", ns.host_ranks)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    host = ns.host_ranks or per_node
    if host < per_node:
        raise ConfigError(f"--host-ranks {host} is fewer than the node's own ranks (--nproc "
                          f"{per_node}): give at least {per_node}")
    if not 0 <= ns.min_time < math.inf:
        raise ConfigError(f"--min-time must be seconds >= 0, got {ns.min_time:g}")
    compute = ns.compute_ms / 1e3 if ns.compute_ms is not None else None
    if compute is not None and not 0 < compute < math.inf:
        raise ConfigError(f"--compute-ms must be a number > 0, got {ns.compute_ms:g}")
    _check_params(ns.params)
    with using_threads(rank_threads(host)):   # all of it as one rank of the job runs
        work, measured = _measure(ns, compute, per_node, host)
        flops = measure_flops()

    def rows_at(compute_s: float, node: Optional[float]) -> list:
        return predict(dataclasses.replace(work, compute_s=compute_s), nodes, link, per_node,
                       inside, rank=ns.powersgd_rank, flops_per_s=flops,
                       hook_seconds={h: t.median for h, t in measured.hooks.items()},
                       node_step=node)

    timed_node = measured.node
    rows = rows_at(work.compute_s, timed_node.median if timed_node else None)
    # a hook is recommended for a gain that holds at the slow end of the measured compute too
    slow = rows_at(measured.compute.high, timed_node.high if timed_node else None) \
        if measured.compute is not None else []
    print(table(rows))
    for line in advice(rows, ns.powersgd_rank, slow):
        print(line)
    for line in assumptions(work, link, measured, inside):
        print(f"assumed: {line}")
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(as_json(rows, work, link, measured, slow) + "\n")
    return 0


def _check_params(params: Optional[float]) -> None:
    """``--params``: a count from 1 to what plan models (:data:`ddpkit.plan.predict.MAX_PARAMS`)."""
    from ..plan.predict import MAX_PARAMS

    if params is not None and not 1 <= params < math.inf:
        raise ConfigError(f"--params must be a parameter count >= 1 (e.g. 25e6), got {params:g}")
    if params is not None and params > MAX_PARAMS:
        raise ConfigError(f"--params {params:g} is more than plan models (at most "
                          f"{MAX_PARAMS:g}: DDP holds the whole model, its gradients and its "
                          "optimizer state on every rank); give a count up to that")


def _per_node(text: str) -> int:
    """``--nproc``: what ``ddpkit train --nproc`` would start on this node."""
    import torch

    from ..job.start import job_nproc

    try:
        return job_nproc(text, torch.cuda.device_count())
    except ConfigError:
        raise ConfigError(f"--nproc {text!r}: give the ranks per node (a number >= 1) or "
                          "auto") from None


def _scaled(timing, factor: float):  # -> Timing
    """``timing`` of a slice, as the whole (``factor`` times as many alike matrices) takes it."""
    return dataclasses.replace(timing, median=timing.median * factor, low=timing.low * factor,
                               high=timing.high * factor)


def _measure(ns: argparse.Namespace, compute, per_node: int, host: int
             ):  # -> (Workload, Measured)
    """The workload and how it was measured: the job's step and each hook's compute, timed on
    the ``host`` ranks at once (the node's, or ``--host-ranks``: ``ddpkit.plan.calibrate``)
    with this process's threads (a rank's: see ``_cmd_plan``)."""

    import torch

    from ..plan.calibrate import calibrate
    from ..plan.measure import Measured, job_input, job_workload, parse_shape
    from ..plan.predict import HOOK_SLICE, HOOKS, synthetic_workload
    from ..cost.model import DEFAULT_RANKS

    shape = parse_shape(ns.input_shape) if ns.input_shape else None
    device = "cuda" if torch.cuda.is_available() else "cpu"   # as train's --accelerator auto
    measured = Measured(None, torch.get_num_threads(), device, per_node,
                        host_ranks=host if host != per_node else 0)
    hooks = {h: ns.powersgd_rank or DEFAULT_RANKS.get(h, 2) for h in HOOKS if h != "none"}
    if ns.params is not None:
        if compute is None:
            raise ConfigError("--params needs --compute-ms (a training step of one rank's "
                              "batch): without the model there is nothing to measure")
        work = synthetic_workload(int(ns.params), compute, ns.batch)
        # the hooks timed on a slice of the gradients (alike matrices), never the whole model
        part = synthetic_workload(min(work.params, HOOK_SLICE), compute, ns.batch)
        timed = calibrate({"shapes": part.bucket_shapes, "batch": ns.batch}, host,
                          measured.threads, hooks, ns.repeats, False, device, per_node=per_node,
                          min_time_s=ns.min_time)
        if part.params < work.params:
            timed = {h: _scaled(t, work.params / part.params) for h, t in timed.items()}
            work = dataclasses.replace(work, name=f"{work.name}; hooks timed on "
                                                  f"{part.params:,} of them and scaled")
        return work, dataclasses.replace(measured, hooks=timed)
    from ..job.config import TrainConfig

    model = ns.model or TrainConfig.model
    inp = job_input(model, ns.data, ns.data_dir, shape)   # refused here, before any process
    work = job_workload(model, inp, ns.batch, compute or 0.0)   # an unknown model too
    job = {"model": model, "data": ns.data, "data_dir": ns.data_dir, "shape": shape,
           "batch": ns.batch}
    timed = calibrate(job, host, measured.threads, hooks, ns.repeats, compute is None, device,
                      per_node=per_node, min_time_s=ns.min_time)
    step, node = timed.pop("compute", None), timed.pop("node", None)
    if step is not None:
        work = dataclasses.replace(work, compute_s=step.median)
    return work, dataclasses.replace(measured, input=inp, compute=step, hooks=timed, node=node)
