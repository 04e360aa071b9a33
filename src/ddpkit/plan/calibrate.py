"""What one rank of the job costs, timed as the job's ranks run: the node's ranks started at once
on this host, each timing the job's training step (its batch drawn, the buffers' broadcast
between them, forward, loss, backward, the optimizer) under DDP over a process group of its own
(its bucket copies and averaging run, its all-reduce costs nothing) and each comm hook on the
gradients' shapes, in step; the slowest rank's timings. ``python -m ddpkit.plan.calibrate``
is one such rank.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from ..cost.measure import Timing, sync_device
from ..launchers.forked import Forked

__all__ = ["calibrate", "main"]

#: A rank waits this long for the others before giving up (a rank that died).
WAIT_S = 300
#: Timed steps stop at this many however short a step is (unless ``repeats`` asks for more).
MOST_REPEATS = 100


def calibrate(job: Dict[str, Any], ranks: int, threads: int, hooks: Dict[str, int],
              repeats: int = 7, step: bool = True, device: str = "cpu",
              timeout_s: float = 900, per_node: int = 0,
              min_time_s: float = 0.5) -> Dict[str, Timing]:
    """Time ``job`` (``model``, ``data``, ``data_dir``, ``shape``, ``batch``: see
    :func:`ddpkit.plan.measure.job_input`; or ``shapes``, the gradients' buckets of a model
    known only by them, for its hooks alone) on ``ranks`` processes at once with ``threads``
    each: its training step (when ``step``; key ``"compute"``) and each hook of ``hooks``
    (PowerSGD's rank as the value), at least ``repeats`` times after warm-up and for at least
    ``min_time_s`` (a short step is timed more often, up to :data:`MOST_REPEATS`: seven steps of
    20 ms are 0.14 s of this host's phases, and the default job's predicted PowerSGD gain
    over bf16 moved 14.5-19.9% between plan runs; over 21 of them, 17.0-18.0%); with
    ``per_node`` > 1
    (default: ``ranks``), also the node's whole step (key ``"node"``): the gradients
    all-reduced between its ``per_node`` ranks, the buffers broadcast, as the job runs on one
    node (on 2 cores its all-reduce of 123 KB cost 2-3 ms a step, where a link model said
    0.35). A rank timed alone
    misses what the node's other ranks take from it (3 ranks on 2 cores ran lock-step DDP at
    30 ms a step where one alone said 20).

    Example::

        calibrate({"model": "small_cnn", "batch": 32}, ranks=2, threads=1, hooks={"bf16": 0})
    """
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # OMP_NUM_THREADS as ddpkit's launchers pass it to a rank: set_num_threads alone left the
    # OpenMP pool of the import spinning beside the other rank (2.0 s a ResNet-18 step here,
    # where the job's ranks took 1.3 s)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="ddpkit-plan-") as tmp:
        spec = {**job, "world": ranks, "per_node": per_node or ranks, "threads": threads,
                "hooks": hooks, "repeats": repeats, "min_time": min_time_s,
                "step": step, "device": device, "store": os.path.join(tmp, "store")}
        # forked from this process's fork server (torch imported once for every timing here,
        # where a fresh interpreter a rank imported it again each time)
        procs = [Forked(["-m", "ddpkit.plan.calibrate", json.dumps(spec), str(r)], env=env,
                        cwd=os.getcwd()) for r in range(ranks)]
        failed = _wait(procs, timeout_s)
        said = [text for proc in procs for text in proc.communicate(timeout=30)]
    if failed is not None:
        lines = (said[2 * failed + 1].strip() or f"no answer within {timeout_s:g} s").splitlines()
        raise RuntimeError(f"timing the job on {ranks} rank(s) failed on rank {failed}: "
                           f"{lines[-1]}")
    found = json.loads(said[0].strip().splitlines()[-1])
    return {name: Timing.of(samples) for name, samples in found.items()}


def _wait(procs: List[Forked], timeout_s: float) -> Optional[int]:
    """Wait for every rank; the first that fails (or, past ``timeout_s``, the first still
    running) stops the rest. Returns that rank, or None when all ended well."""
    deadline = time.monotonic() + timeout_s
    while any(p.returncode is None for p in procs):
        bad = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
        late = time.monotonic() > deadline
        if bad is not None or late:
            for p in procs:
                if p.returncode is None:
                    p.kill()
            return bad if bad is not None else 0
        time.sleep(0.02)
    return next((r for r, p in enumerate(procs) if p.returncode != 0), None)


def _count(probe_s: float, repeats: int, min_time_s: float) -> int:
    """How many timed steps: at least ``repeats``, and enough for ``min_time_s`` at the slowest
    rank's ``probe_s`` a step (so every rank counts the same), at most :data:`MOST_REPEATS`."""
    import torch.distributed as dist

    slowest = torch.tensor([probe_s], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    wanted = math.ceil(min_time_s / max(slowest.item(), 1e-9))
    return max(repeats, min(MOST_REPEATS, wanted))


def _in_step(fn: Callable[[], Any], repeats: int, device: torch.device, min_time_s: float = 0.0,
             warmup: int = 2, chained: bool = False) -> List[float]:
    """``fn`` timed on every rank, each time started together (a barrier): ``repeats`` times,
    or more for ``min_time_s`` of them (the last warm-up call says how long one takes).
    ``chained``: one barrier, then the calls back to back, each timed from the end of the one
    before, as training runs steps whose all-reduces keep the ranks in step: a barrier before
    each charged the step with how late the ranks left it (on a 2-vCPU VM a woken thread waits
    up to a 4 ms tick), and the node's measured step came out 33% over training's."""
    import torch.distributed as dist

    probe = 0.0
    for _ in range(warmup):
        sync_device(device)
        start = time.perf_counter()
        fn()
        sync_device(device)
        probe = time.perf_counter() - start
    samples = []
    if chained:
        sync_device(device)
        dist.barrier()
    start = time.perf_counter()
    for _ in range(_count(probe, repeats, min_time_s)):
        if not chained:
            sync_device(device)
            dist.barrier()
            start = time.perf_counter()
        fn()
        sync_device(device)
        end = time.perf_counter()
        samples.append(end - start)
        start = end
    return samples


def _hook_in_step(shapes: Sequence[Any], hook: str, rank: int, group: Any, repeats: int,
                  device: torch.device, min_time_s: float = 0.0) -> List[float]:
    """The hook as the DDP engine registers it, over ``group`` (this rank's own), each step
    started together: from the barrier after one step to the end of the next is one step
    (the first, a warm-up that allocates PowerSGD's P, Q and error, drops); ``repeats`` of
    them, or more for ``min_time_s`` (a probe of one step says how long one takes)."""
    import torch.distributed as dist

    from ..cost.measure import time_hooks
    from ..engines.ddp import comm_hook_for
    from ..base.wrap import WrapOptions

    ends: List[float] = []
    starts: List[float] = []

    def after_step() -> None:
        ends.append(time.perf_counter())
        dist.barrier()
        starts.append(time.perf_counter())

    def make(name: str, r: int, g: Any = None) -> Any:
        return comm_hook_for(name, WrapOptions(powersgd_rank=r), g)

    probe = time_hooks(shapes, [(hook, rank)], make, device, group=group, steps=1)
    steps = _count(probe[(hook, rank)], repeats, min_time_s)
    time_hooks(shapes, [(hook, rank)], make, device, group=group, steps=steps,
               after_step=after_step)
    return [end - start for start, end in zip(starts, ends[1:])]


def _batches(inp: Any, batch: int, device: torch.device) -> Iterator[Any]:
    """Batches as the job's loader gives them on CPU: drawn from its dataset through a
    DataLoader (no workers, as ``ddpkit train``'s default), which is part of a step; on a GPU
    (the job keeps the data there) or without the dataset, one batch again and again."""
    from torch.utils.data import DataLoader

    from .measure import job_batch

    if device.type != "cpu" or inp.dataset is None or len(inp.dataset) < batch:
        fixed = job_batch(inp, batch, device)
        while True:
            yield fixed
    while True:
        yield from DataLoader(inp.dataset, batch_size=batch, shuffle=True, drop_last=True)


def _training_step(model: torch.nn.Module, group: Any, batches: Iterator[Any],
                   broadcast: bool) -> Callable[[], None]:
    """The job's step under DDP over ``group``; ``broadcast``: the buffers broadcast over every
    rank timed, as DDP does before every training forward (over a group of one it skips it,
    where the job's ranks meet there)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ..training.batches import default_loss, logits_of
    from ..job.build import build_optimizer
    from ..job.config import TrainConfig

    ddp = DistributedDataParallel(model, process_group=group)
    optimizer = build_optimizer(TrainConfig(), ddp)   # the job's: SGD with momentum
    buffers = list(model.buffers()) if broadcast else []

    def step() -> None:
        x, y = next(batches)
        if buffers:
            dist.broadcast(torch.cat([b.detach().reshape(-1).view(torch.uint8)
                                      for b in buffers]), src=0)
        optimizer.zero_grad(set_to_none=True)
        default_loss(logits_of(ddp(x)), y).backward()
        optimizer.step()

    return step


def _time_step(spec: Dict[str, Any], rank: int, device: torch.device, alone: List[Any],
               nodes: List[Any], per_node: int, found: Dict[str, List[float]]) -> List[Any]:
    """The job's step (and the node's whole step) into ``found``; its gradients' buckets."""
    from ..cost.measure import workload_of
    from .measure import job_input, job_model

    inp = job_input(spec["model"], spec.get("data"), spec.get("data_dir"), spec.get("shape"))
    model = job_model(spec["model"], inp).to(device).train()
    if spec["step"]:
        batches = _batches(inp, spec["batch"], device)
        if per_node > 1:   # the node's own job: its gradients all-reduced between its ranks
            found["node"] = _in_step(_training_step(copy.deepcopy(model), nodes[rank // per_node],
                                                    batches, False), spec["repeats"], device,
                                     spec["min_time"], chained=True)
        found["compute"] = _in_step(_training_step(model, alone[rank], batches,
                                                   spec["world"] > 1), spec["repeats"], device,
                                    spec["min_time"])
    return list(workload_of(model, 0.0, spec["batch"]).bucket_shapes)


def _rank(spec: Dict[str, Any], rank: int) -> Dict[str, List[float]]:
    """One rank: the job's step under DDP over its own group, then each hook; every rank's
    samples, step by step, the slowest's (they ran in step)."""
    import torch.distributed as dist

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else \
        torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    world, per_node = spec["world"], spec.get("per_node") or spec["world"]
    # every rank makes every group, in the same order
    alone = [dist.new_group([r], backend=backend) for r in range(world)]
    nodes = [dist.new_group(list(range(s, min(s + per_node, world))), backend=backend)
             for s in range(0, world, per_node)] if per_node > 1 else alone
    found: Dict[str, List[float]] = {}
    if "shapes" in spec:   # a model known by its gradients' shapes: its hooks alone
        shapes = [[tuple(s) for s in bucket] for bucket in spec["shapes"]]
    else:
        shapes = _time_step(spec, rank, device, alone, nodes, per_node, found)
    for hook, power_rank in spec["hooks"].items():
        found[hook] = _hook_in_step(shapes, hook, power_rank, alone[rank], spec["repeats"],
                                    device, spec["min_time"])
    names = list(found)
    flat = torch.tensor([s for n in names for s in found[n]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)   # step by step, the slowest rank's
    out, at = {}, 0
    for name in names:
        out[name], at = flat[at:at + len(found[name])].tolist(), at + len(found[name])
    return out


def main(argv: Optional[List[str]] = None) -> None:
    """One rank: ``python -m ddpkit.plan.calibrate SPEC_JSON RANK`` (started by
    :func:`calibrate`); rank 0 prints the slowest rank's samples as JSON.

    Example::

        main([json.dumps(spec), "0"])
    """
    import torch.distributed as dist

    args = sys.argv[1:] if argv is None else argv
    spec, rank = json.loads(args[0]), int(args[1])
    torch.set_num_threads(spec["threads"])   # a rank's share, as ddpkit train sets it
    dist.init_process_group("gloo", init_method="file://" + spec["store"], rank=rank,
                            world_size=spec["world"], timeout=timedelta(seconds=WAIT_S))
    found = _rank(spec, rank)
    if rank == 0:
        print(json.dumps(found), flush=True)
    # not a clean exit: a group made here can be freed last by one of gloo's own threads,
    # which then joins itself and aborts the process ("Resource deadlock avoided")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
