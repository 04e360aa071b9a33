"""What stopping costs: the per-step agreement on a stop signal, and signal -> checkpoint -> exit.

    python benchmarks/stop_cost.py                 # both parts, about 2 minutes on 2 cores

1. Inside ``fit`` the ranks ask whether one of them got SIGTERM / SIGUSR1: a reduction of a
   number that runs in the background, read at the next question; every step for 20 steps, then
   about every 0.25 s (rank 0 measures the step time and tells the others once). Measured on
   2 processes (gloo) as the median time of that question, beside a blocking reduction and the
   median optimizer step of the default ``ddpkit train`` job, in the same run.
2. ``ckpt.step()`` in a script's own loop (``rt.checkpointer``): the same question plus the step
   count and the "is a save due" check, median over 1000 steps with no save due.
3. SIGTERM to ``ddpkit train`` (ResNet-18 on synthetic CIFAR-shaped data, 2 processes): seconds
   from the signal to the saved checkpoint (as rank 0 prints it) and to the launcher's exit.
"""
from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import ddpkit
from ddpkit.engines import comm
from ddpkit.faults.stops import Stops


def agreement_cost(calls: int = 1000, step_s: float = 0.005) -> dict:
    """Median time of the per-step stop question as fit asks it (``Stops.poll``: start this
    step's reduction, read the last one's), with ``step_s`` of other work between questions;
    beside it, a blocking reduction of the same number."""
    rt = ddpkit.setup()
    stops = Stops()
    stops.installed = True  # ask as fit does; no handlers needed to time it
    polled, blocking = [], []
    for _ in range(calls):
        time.sleep(step_s)
        start = time.perf_counter()
        stops.poll(rt.engine)
        polled.append(time.perf_counter() - start)
        start = time.perf_counter()
        comm.reduce(0, "max")
        blocking.append(time.perf_counter() - start)
    stops.settle()
    rt.shutdown()
    return {"median_us": 1e6 * statistics.median(polled),
            "blocking_us": 1e6 * statistics.median(blocking), "calls": calls}


def checkpointer_step_cost(directory: str, calls: int = 1000, step_s: float = 0.005) -> dict:
    """Median time of ``ckpt.step()`` in a user's loop with no save due, ``step_s`` of other
    work between steps (the first 20 ask every step, as in fit)."""
    import torch

    rt = ddpkit.setup()
    model = rt.wrap(torch.nn.Linear(4, 4))
    ckpt = rt.checkpointer(directory, model=model, every_epoch=False, resume=None)
    times = []
    for _ in range(calls):
        time.sleep(step_s)
        start = time.perf_counter()
        ckpt.step()
        times.append(time.perf_counter() - start)
    ckpt.close()
    rt.shutdown()
    return {"median_us": 1e6 * statistics.median(times),
            "first20_us": 1e6 * statistics.median(times[:20]), "calls": calls}


def _train(out: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--output", out,
                             "--no-progress", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def step_ms(out: str) -> float:
    """Median optimizer step of the default job (ms), from its per-epoch lines."""
    proc = _train(out, "--epochs", "4")
    stdout, _ = proc.communicate(timeout=600)
    steps = [float(m) for m in re.findall(r"step ([0-9.]+) ms", stdout)]
    return statistics.median(steps[1:] or steps)


def sigterm_to_checkpoint(out: str, wait: float = 40.0) -> dict:
    """SIGTERM to a ResNet-18 job once training runs: seconds to the checkpoint and to exit."""
    proc = _train(out, "--model", "resnet18", "--data", "synthetic", "--epochs", "50",
                  "--batch-size", "32", "--synthetic-samples", "4096", "--eval-every", "0")
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not os.path.isdir(os.path.join(out, "tensorboard")):
        time.sleep(0.2)
    time.sleep(10)  # well inside the first epoch
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    found = re.search(r"saved ([0-9.]+) s after the signal", stdout)
    return {"returncode": proc.returncode, "to_checkpoint_s": float(found.group(1)) if found
            else None, "to_exit_s": round(time.monotonic() - start, 2),
            "line": stderr.strip().splitlines()[-1] if stderr.strip() else ""}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cost = ddpkit.launch(agreement_cost, 2)
        step = step_ms(os.path.join(tmp, "digits"))
        asked_every = max(1, round(250 / step))  # fit asks about every 0.25 s after step 20
        print(f"stop question: {cost['median_us']:.0f} us median over {cost['calls']} questions "
              f"(2 processes, gloo; a blocking all-reduce of the same number: "
              f"{cost['blocking_us']:.0f} us); default job's optimizer step {step:.1f} ms "
              f"median, asked every {asked_every} steps after step 20: "
              f"{cost['median_us'] / 10 / step / asked_every:.3f} % of the training time")
        own = ddpkit.launch(checkpointer_step_cost, 2, os.path.join(tmp, "own"))
        print(f"ckpt.step() in a user's loop: {own['median_us']:.0f} us median over "
              f"{own['calls']} steps ({own['first20_us']:.0f} us over the first 20, which ask "
              f"every step); at the default job's {step:.1f} ms step: "
              f"{own['median_us'] / 10 / step:.3f} % of the training time")
        stop = sigterm_to_checkpoint(os.path.join(tmp, "resnet"))
        print(f"SIGTERM -> checkpoint {stop['to_checkpoint_s']} s (as rank 0 reports it), "
              f"-> launcher exit {stop['to_exit_s']} s, status {stop['returncode']}; "
              f"{stop['line']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
