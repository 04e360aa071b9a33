"""What rt.loader(seed_each_sample=True) costs a sample: one pass over a dataset of small
tensors through a DataLoader (no workers), each sample seeded on its own against the default
(the dataset as it is), timed in turns (A B A B) so a slow phase of the host falls on both.

    python benchmarks/seed_each_sample.py [--samples 4096] [--batch 64] [--rounds 5]
"""
import argparse
import statistics
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ddpkit.data.seeds import EpochTagged, SeededEachSample


class Augmented(Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 3, 8, 8)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x * float(np.random.uniform(0.9, 1.1))


class _Epoch0:  # EpochTagged reads the sampler's epoch
    def __init__(self, n):
        self.n, self.epoch = n, 0

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


def one_pass(each: bool, n: int, batch: int) -> float:
    data = Augmented(n)
    loader = DataLoader(SeededEachSample(data, 0, n), batch_size=batch,
                        sampler=EpochTagged(_Epoch0(n), n)) if each else \
        DataLoader(data, batch_size=batch)
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    times = {False: [], True: []}
    for _ in range(a.rounds):
        for each in (False, True):
            times[each].append(one_pass(each, a.samples, a.batch))
    base, each = statistics.median(times[False]), statistics.median(times[True])
    print(f"per sample: default {1e6 * base / a.samples:.1f} us, seed_each_sample "
          f"{1e6 * each / a.samples:.1f} us, +{1e6 * (each - base) / a.samples:.1f} us "
          f"(median of {a.rounds} passes of {a.samples} samples, batch {a.batch})")


if __name__ == "__main__":
    main()
