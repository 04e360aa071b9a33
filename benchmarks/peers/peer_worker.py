"""One rank of one or several peers' training loops, started by torchrun from run_peers.py.

Four loops over the same model, data, per-rank batch and threads; rank 0 writes every rank's
step times to --result. Each step is timed from fetching the batch to optimizer.step returning
(on CUDA, to the device finishing it: the step ends with a synchronize in every peer alike).
``--device cuda`` puts every peer on the rank's GPU (NCCL; batches copied from a CPU loader).
With several peers (``--peer handwritten,ddpkit``) every loop is built in this one job, each with
its own model, optimizer and loader, and their steps alternate (A B A B, order rotated every
step): drift of the machine then hits all of them within seconds of each other.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.job.datasets import synthetic
from ddpkit.job.models import build_model

LR, MOMENTUM, SEED = 0.1, 0.9, 0


def _data(args: argparse.Namespace) -> Any:
    return synthetic(args.epoch_size, shape=(3, 32, 32), num_classes=100, seed=SEED)


def _model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(SEED)  # identical initial weights on every rank and in every peer
    return build_model(args.model, num_classes=100, in_channels=3)


def _epochs(make_pass: Callable[[int], Iterator[Any]]) -> Iterator[Any]:
    epoch = 0
    while True:
        yield from make_pass(epoch)
        epoch += 1


def _cuda(args: argparse.Namespace) -> bool:
    return args.device == "cuda"


def _device(args: argparse.Namespace) -> torch.device:
    if _cuda(args):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _mark(marks: Optional[List[float]]) -> None:
    """Phase boundary inside a step (after data, forward, backward), for components.py."""
    if marks is not None:
        marks.append(time.perf_counter())


def handwritten(args: argparse.Namespace,
                marks: Optional[List[float]] = None) -> Callable[[], None]:
    """The tutorials' DDP loop in plain PyTorch: init_process_group, DDP, DistributedSampler."""
    device = _device(args)
    if _cuda(args):
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # (interleaved with other peers, one of them may have)
        dist.init_process_group("nccl" if _cuda(args) else "gloo")  # env:// from torchrun
    model = nn.parallel.DistributedDataParallel(
        _model(args).to(device), device_ids=[device.index] if _cuda(args) else None)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = _data(args)
    sampler = DistributedSampler(data, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)

    def one_pass(epoch: int) -> Iterator[Any]:
        sampler.set_epoch(epoch)
        return iter(loader)
    batches = _epochs(one_pass)

    def step() -> None:
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        _mark(marks)
        loss = nn.functional.cross_entropy(model(x), y)
        _mark(marks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _mark(marks)
        opt.step()
    return step


def ddpkit_loop(args: argparse.Namespace, marks: Optional[List[float]] = None,
                resident: Any = "auto", **wrap_options: Any) -> Callable[[], None]:
    """The ddpkit path users write: setup, rt.wrap, rt.loader, Accumulator, Precision."""
    import ddpkit
    rt = ddpkit.setup(seed=SEED, accelerator=args.device)
    torch.set_num_threads(args.threads)  # setup() may have chosen threads; the peers must match
    model = rt.wrap(_model(args), **wrap_options)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = rt.loader(_data(args), batch_size=args.batch * rt.world_size, seed=SEED,
                       drop_last=True, resident=resident)
    acc = ddpkit.Accumulator(model, opt, ddpkit.Precision("fp32", rt.device))
    batches = _epochs(lambda epoch: iter(loader))  # the loader calls set_epoch itself

    def step() -> None:
        x, y = rt.to_device(*next(batches))
        _mark(marks)
        with acc.micro_step():  # the optimizer steps when it exits
            with acc.precision.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            _mark(marks)
            acc.backward(loss)
            _mark(marks)
    return step


def accelerate_loop(args: argparse.Namespace) -> Callable[[], None]:
    """Hugging Face Accelerate: Accelerator(cpu=...), prepare(), accelerator.backward."""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=not _cuda(args))
    torch.set_num_threads(args.threads)
    model = _model(args)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = DataLoader(_data(args), batch_size=args.batch, shuffle=True, drop_last=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    def one_pass(epoch: int) -> Iterator[Any]:
        loader.set_epoch(epoch)
        return iter(loader)
    batches = _epochs(one_pass)

    def step() -> None:
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        opt.step()
    return step


def fabric_loop(args: argparse.Namespace) -> Callable[[], None]:
    """Lightning Fabric: Fabric(accelerator=cpu|cuda, strategy='ddp'), setup, fabric.backward."""
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator=args.device, devices=int(os.environ["WORLD_SIZE"]), strategy="ddp")
    fabric.launch()  # under torchrun the processes exist: this only connects them
    torch.set_num_threads(args.threads)
    model = _model(args)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(_data(args), batch_size=args.batch,
                                                 shuffle=True, drop_last=True))
    batches = _epochs(lambda epoch: iter(loader))  # Fabric's loader sets the sampler epoch

    def step() -> None:
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        fabric.backward(loss)
        opt.step()
    return step


def ddpkit_no_bucket_view(args: argparse.Namespace) -> Callable[[], None]:
    """Diagnostic: ddpkit with DDP's default ``gradient_as_bucket_view=False`` (ddpkit's is True)."""
    return ddpkit_loop(args, gradient_as_bucket_view=False)


def ddpkit_dataloader(args: argparse.Namespace) -> Callable[[], None]:
    """ddpkit with ``rt.loader(resident=False)``: a torch DataLoader feeding batches from host
    memory, as the other peers do (on a GPU, ``rt.loader`` by default keeps data that fits there
    and gathers batches on the device: a different data path, not a different step)."""
    return ddpkit_loop(args, resident=False)


PEERS: Dict[str, Callable[[argparse.Namespace], Callable[[], None]]] = {
    "handwritten": handwritten, "ddpkit": ddpkit_loop, "accelerate": accelerate_loop,
    "fabric": fabric_loop, "ddpkit-nobv": ddpkit_no_bucket_view,
    "ddpkit-dataloader": ddpkit_dataloader,
    # A/A control: a second, identical hand-written loop. Its ratio to "handwritten" is the
    # measurement's own noise floor, the yardstick for any other peer's difference.
    "handwritten-copy": handwritten}


def _timed(steps_by_peer: Dict[str, Callable[[], None]], warmup: int,
           steps: int, sync: Callable[[], None] = lambda: None
           ) -> Dict[str, Dict[str, List[float]]]:
    """Wall and CPU seconds per step, warm-up excluded. With several peers their steps alternate:
    warm-up each, then A B C, B C A, ... (same order on all ranks, so their collectives match).
    CPU: the work is done when optimizer.step returns."""
    names = list(steps_by_peer)
    for _ in range(warmup):
        for name in names:
            steps_by_peer[name]()
    out: Dict[str, Dict[str, List[float]]] = {n: {"step_s": [], "cpu_s": []} for n in names}
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            steps_by_peer[name]()
            sync()
            out[name]["step_s"].append(time.perf_counter() - start)
            out[name]["cpu_s"].append(time.process_time() - start_cpu)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", required=True,
                   help=f"one of {', '.join(PEERS)}, or several comma-separated (interleaved)")
    for flag, default in (("--batch", 64), ("--threads", 1), ("--steps", 4), ("--warmup", 1),
                          ("--epoch-size", 50_000)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--result", required=True)
    args = p.parse_args()
    names = args.peer.split(",")
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    torch.set_num_threads(args.threads)
    steps: Dict[str, Callable[[], None]] = {}
    for name in names:
        steps[name] = PEERS[name](args)
        torch.set_num_threads(args.threads)  # again: a framework may have changed it on set-up
    timed = _timed(steps, args.warmup, args.steps,
                   torch.cuda.synchronize if _cuda(args) else (lambda: None))
    extra = {"threads": torch.get_num_threads(),
             "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    ranks: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {name: {**t, **extra} for name, t in timed.items()})
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"peers": {n: [r[n] for r in ranks] for n in names}}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
