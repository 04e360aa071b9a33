"""Does torch.save in a thread hold the GIL? Count a pure-Python loop's iterations in the main
thread for 1.5 s with and without a background save of 400 MB (written and fsynced),
alternating 3 times.

    python benchmarks/ckpt_async/gil.py
"""
import os
import tempfile
import threading
import time

import torch

PATH = os.path.join(tempfile.gettempdir(), "ddpkit-gil-check.pt")


def spin(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def save(state: dict) -> None:
    with open(PATH, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    state = {"w": torch.randn(100_000_000)}
    for _ in range(3):
        alone = spin(1.5)
        writer = threading.Thread(target=save, args=(state,))
        began = time.perf_counter()
        writer.start()
        during = spin(1.5)
        writer.join()
        print(f"alone {alone}  during a save {during}  ratio {during / alone:.2f}  "
              f"save {time.perf_counter() - began:.2f} s", flush=True)
    os.unlink(PATH)


if __name__ == "__main__":
    main()
