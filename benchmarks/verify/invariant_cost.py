"""What ``ddpkit verify``'s invariants cost a rank per recorded step: the replica checksums
(parameters, buffers, optimizer state, learning rates, module modes), the generators' checksum,
and once per run the dataset's three sample checksums; against the step itself (forward,
backward, optimizer step) on the same model and batch. Alternated A B A B, medians.

    python benchmarks/verify/invariant_cost.py          # the README's MLP and ResNet-18
"""
import statistics
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.job.models import resnet18
from ddpkit.verify.probe_loader import dataset_digests
from ddpkit.verify.probe_rng import rng, rng_digest
from ddpkit.verify.probe_watch import replica_digests


def case(name, model, batch, repeats=7):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = batch

    def step():
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def invariants():
        replica_digests([model], opt)
        rng_digest(rng())

    step()  # momentum buffers exist
    steps, checks = [], []
    for _ in range(repeats):
        for fn, out in ((step, steps), (invariants, checks)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    data = TensorDataset(x, y)
    start = time.perf_counter()
    dataset_digests(data)
    once = time.perf_counter() - start
    s, c = statistics.median(steps), statistics.median(checks)
    print(f"{name:28} step {s * 1e3:9.2f} ms  invariants {c * 1e3:7.2f} ms "
          f"({100 * c / s:5.1f} % of a step)  dataset checksums once {once * 1e3:6.2f} ms")


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(1)
    mlp = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    case("README MLP, batch 32", mlp, (torch.randn(32, 20), torch.randint(0, 4, (32,))))
    case("ResNet-18 32x32, batch 64", resnet18(10), (torch.randn(64, 3, 32, 32),
                                                     torch.randint(0, 10, (64,))))
