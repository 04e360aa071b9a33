"""One rank of one peer's training loop, started by torchrun from run_peers.py.

Four loops over the same model, data, per-rank batch and threads; rank 0 writes every rank's
step times to --result. Each step is timed from fetching the batch to optimizer.step returning.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any, Callable, Dict, Iterator, List

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.datasets import synthetic
from ddpkit.models import build_model

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


def handwritten(args: argparse.Namespace) -> Callable[[], None]:
    """The tutorials' DDP loop in plain PyTorch: init_process_group, DDP, DistributedSampler."""
    dist.init_process_group("gloo")  # env:// from torchrun
    model = nn.parallel.DistributedDataParallel(_model(args))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = _data(args)
    sampler = DistributedSampler(data, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)

    def one_pass(epoch: int) -> Iterator[Any]:
        sampler.set_epoch(epoch)
        return iter(loader)
    batches = _epochs(one_pass)

    def step() -> None:
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def ddpkit_loop(args: argparse.Namespace) -> Callable[[], None]:
    """The ddpkit path users write: setup, rt.wrap, rt.loader, Accumulator, Precision."""
    import ddpkit
    rt = ddpkit.setup(seed=SEED)
    torch.set_num_threads(args.threads)  # setup() may have chosen threads; the peers must match
    model = rt.wrap(_model(args))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = rt.loader(_data(args), batch_size=args.batch * rt.world_size, seed=SEED,
                       drop_last=True)
    acc = ddpkit.Accumulator(model, opt, ddpkit.Precision("fp32", rt.device))
    batches = _epochs(lambda epoch: iter(loader))  # the loader calls set_epoch itself

    def step() -> None:
        x, y = rt.to_device(*next(batches))
        with acc.micro_step():
            with acc.precision.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
    return step


def accelerate_loop(args: argparse.Namespace) -> Callable[[], None]:
    """Hugging Face Accelerate: Accelerator(cpu=True), prepare(), accelerator.backward."""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
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
    """Lightning Fabric: Fabric(accelerator='cpu', strategy='ddp'), setup, fabric.backward."""
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp")
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


PEERS: Dict[str, Callable[[argparse.Namespace], Callable[[], None]]] = {
    "handwritten": handwritten, "ddpkit": ddpkit_loop, "accelerate": accelerate_loop,
    "fabric": fabric_loop}


def _timed(step: Callable[[], None], warmup: int, steps: int) -> Dict[str, List[float]]:
    wall: List[float] = []
    cpu: List[float] = []
    for i in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()  # CPU: the work is done when optimizer.step returns
        if i >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return {"step_s": wall, "cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", choices=list(PEERS), required=True)
    for flag, default in (("--batch", 64), ("--threads", 1), ("--steps", 4), ("--warmup", 1),
                          ("--epoch-size", 50_000)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--result", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    step = PEERS[args.peer](args)
    torch.set_num_threads(args.threads)  # again: a framework may have changed it on set-up
    mine = {**_timed(step, args.warmup, args.steps), "threads": torch.get_num_threads(),
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    ranks: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"peer": args.peer, "ranks": ranks}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
