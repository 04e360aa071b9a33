"""What the own-loop work costs on the training path, measured side by side with an older ddpkit.

    git worktree add /tmp/ddpkit-old f4267d5          # ddpkit before the Checkpointer
    python benchmarks/own_loop_cost.py --old /tmp/ddpkit-old --rounds 4

Alternates old and new (A B A B ...) in one run, part by part, each in a fresh process with ``PYTHONPATH``
pointing at that tree's ``src``:

1. ``fit``: the default ``ddpkit train`` job (2 processes) — its median optimizer step, from the
   epoch lines. New: the loss reduced over ranks every step (async, behind backward) and
   ``fit`` on the ``Checkpointer``.
2. The loader with 2 workers: one pass over 4096 synthetic 3x32x32 images whose ``__getitem__``
   does a random crop + flip from the global RNG (torchvision-like), global batch 128, one
   process — samples per second. New: every sample seeded from (seed, epoch, index) in the
   worker, the base seed from the loader's own generator.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NEW = os.path.dirname(HERE)

LOADER_PASS = r"""
import time, torch
from torch.nn import functional as F
from torch.utils.data import Dataset
from ddpkit.data.loader import make_loader
from ddpkit.env.detect import ClusterEnv

class Images(Dataset):
    def __init__(self):
        self.x = torch.randn(4096, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        top, left = torch.randint(0, 9, (2,)).tolist()
        image = F.pad(self.x[i], (4, 4, 4, 4))[:, top:top + 32, left:left + 32]
        return (image.flip(2) if torch.rand(1).item() < 0.5 else image), i % 10

loader = make_loader(Images(), 128, ClusterEnv(), num_workers=2, seed=0)
for _ in loader:   # the first pass starts the workers
    pass
start = time.perf_counter()
for _ in range(2):
    for _ in loader:
        pass
print(f"samples/s {2 * 4096 / (time.perf_counter() - start):.1f}")
"""


def _run(tree: str, args: list, out: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                         cwd=out, timeout=900)
    if res.returncode:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{res.stderr[-2000:]}")
    return res.stdout


def fit_step_ms(tree: str, out: str) -> float:
    stdout = _run(tree, ["-m", "ddpkit", "train", "--epochs", "4", "--no-progress", "--output",
                         os.path.join(out, "run")], out)
    steps = [float(m) for m in re.findall(r"step ([0-9.]+) ms", stdout)]
    return statistics.median(steps[1:] or steps)  # the first epoch warms up


def loader_rate(tree: str, out: str) -> float:
    return float(re.search(r"samples/s ([0-9.]+)", _run(tree, ["-c", LOADER_PASS], out)).group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="a checkout of the older ddpkit")
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    figures = {(what, tree): [] for what in ("fit", "loader") for tree in ("old", "new")}
    trees = (("old", a.old), ("new", NEW))
    with tempfile.TemporaryDirectory() as tmp:
        # Each part alternates old and new on its own (a job's processes leave the machine busy
        # for a moment: a loader pass right after one reads low).
        for what, measure, rounds in (("fit", fit_step_ms, a.rounds),
                                      ("loader", loader_rate, 2 * a.rounds)):
            for r in range(rounds):
                for name, tree in trees:
                    figures[(what, name)].append(measure(tree, tempfile.mkdtemp(dir=tmp)))
                print(f"{what} round {r + 1}: old {figures[(what, 'old')][-1]:.1f}, new "
                      f"{figures[(what, 'new')][-1]:.1f}", flush=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"fit step (default job, 2 processes): old {med[('fit', 'old')]:.2f} ms, new "
          f"{med[('fit', 'new')]:.2f} ms, new/old {med[('fit', 'new')] / med[('fit', 'old')]:.3f}")
    print(f"loader with 2 workers (crop+flip, batch 128): old {med[('loader', 'old')]:.0f}, new "
          f"{med[('loader', 'new')]:.0f} samples/s, new/old "
          f"{med[('loader', 'new')] / med[('loader', 'old')]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
