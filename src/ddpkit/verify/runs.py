"""Running the user's unchanged script for ``ddpkit verify``: on 1 process (twice, and once with
every batch reversed) and on N, each as ``ddpkit run`` runs it (a free port, the cores split),
with ``ddpkit.setup()`` recording every optimizer step (``ddpkit.probe``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from ..errors import ConfigError
from ..probe import ACCUM_VAR, ORDER_VAR, STEPS_VAR, VERIFY_VAR
from .compare import Verdict, compare
from .records import RunRecord, load

__all__ = ["verify", "run_script", "PLAN"]

#: The runs, in the order they are made: name, processes, batches reversed.
PLAN = (("one", 1, False), ("many", None, False), ("reordered", 1, True), ("again", 1, False))
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")
# DDP's own words when a parameter got no gradient on some rank
_UNUSED = ("Expected to have finished reduction", "did not receive grad",
           "find_unused_parameters")


class Diverged(Exception):
    """A run failed in a way that is itself the answer (DDP's unused-parameter error)."""

    def __init__(self, cause: str, why: str) -> None:
        super().__init__(why)
        self.cause, self.why = cause, why


def run_script(script: str, args: Sequence[str], nproc: int, steps: int, directory: str,
               reverse: bool = False, timeout: Optional[float] = None,
               whole_epoch: bool = True, accum: int = 1) -> RunRecord:
    """Run ``script`` on ``nproc`` processes recording ``steps`` optimizer steps into
    ``directory``; one :class:`ConfigError` line when it fails or records nothing.

    Example::

        run_script("train.py", ["--epochs", "1"], 2, 10, "/tmp/verify/many")
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update({VERIFY_VAR: directory, STEPS_VAR: str(steps), "PYTHONUNBUFFERED": "1"})
    if reverse:
        env[ORDER_VAR] = "reverse"
    if nproc == 1 and accum > 1:
        env[ACCUM_VAR] = str(accum)
    if nproc > 1:
        env.setdefault("TORCH_DISTRIBUTED_DEBUG", "INFO")  # DDP names unused parameters
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc", str(nproc), script,
                           *args], env=env, capture_output=True, text=True, timeout=timeout)
    record = load(directory)
    if proc.returncode != 0 and any(marker in proc.stderr for marker in _UNUSED):
        raise Diverged("unused-parameters", f"on {nproc} processes some parameters got no "
                                            "gradient on some ranks, and DDP stopped waiting "
                                            "for them (unused parameters): make every rank use "
                                            "every parameter in its forward, or wrap with "
                                            "find_unused_parameters=True")
    if proc.returncode != 0:
        raise ConfigError(_failed(script, nproc, proc.stderr, record))
    return _checked(script, record, steps, whole_epoch, accum if nproc == 1 else 1)


def _failed(script: str, nproc: int, stderr: str, record: RunRecord) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith(("error:", "[rank"))), None) or \
        next((line for line in reversed(lines) if not line.startswith("ddpkit run:")), "")
    where = f"after {len(record.steps)} recorded step(s)" if record.started else "at start-up"
    return f"{script} failed on {nproc} process(es) {where}: {said.strip()[:300]}"


def _checked(script: str, record: RunRecord, steps: int, whole_epoch: bool,
             accum: int = 1) -> RunRecord:
    if not record.started:
        raise ConfigError(f"{script} never called ddpkit.setup(): verify watches ddpkit "
                          "scripts; add `rt = ddpkit.setup()` (and rt.wrap, rt.loader) first")
    if not record.steps:
        raise ConfigError(f"{script} ran to the end without an optimizer step: nothing to "
                          "compare; verify a script that trains")
    ends = [s.step for s in record.steps if s.epoch_end]
    if whole_epoch and ends and accum > 1 and ends[0] <= steps:
        raise ConfigError(f"--steps {steps} reaches the end of an epoch ({ends[0]} optimizer "
                          f"steps), whose micro-batches are uneven under --accum-steps "
                          f"{accum}; pass --steps {max(ends[0] - 1, 1)} or less")
    if whole_epoch and ends and ends[0] < steps:  # the 1-process epoch sets the limit
        raise ConfigError(f"--steps {steps} is more than an epoch ({ends[0]} optimizer steps "
                          f"on {record.world_size} process(es)): its last batch is padded "
                          f"differently on N processes; pass --steps {ends[0]} or less")
    if len(record.steps) < steps:
        raise ConfigError(f"{script} ended after {len(record.steps)} optimizer step(s), fewer "
                          f"than --steps {steps} on {record.world_size} process(es); pass "
                          f"--steps {len(record.steps)} or less")
    return record


def verify(script: str, args: Sequence[str] = (), nproc: int = 2, steps: int = 10,
           workdir: Optional[str] = None, timeout: Optional[float] = 900,
           accum: int = 1) -> Verdict:
    """Run ``script`` on 1 and on ``nproc`` processes and compare them step by step; with
    ``accum`` K > 1 the 1-process runs accumulate K micro-batches per step, the batches of K
    ranks (with K = ``nproc``, each micro-batch is one rank's: BatchNorm sees the same batches).

    Example::

        verdict = verify("examples/train_ddpkit.py", ["--epochs", "1"], nproc=2, steps=10)
        verdict.passed
    """
    if nproc < 2:
        raise ConfigError(f"--nproc must be >= 2 to compare with one process, got {nproc}")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if accum < 1:
        raise ConfigError(f"--accum-steps must be >= 1, got {accum}")
    records = {}
    with tempfile.TemporaryDirectory(prefix="ddpkit-verify-", dir=workdir) as tmp:
        try:
            for name, n, reverse in PLAN:
                records[name] = run_script(script, args, n or nproc, steps,
                                           os.path.join(tmp, name), reverse, timeout,
                                           whole_epoch=name == "one", accum=accum)
                if name == "one":
                    _check_divides(records["one"], nproc)
        except Diverged as exc:
            return Verdict(passed=False, steps=[], largest=float("nan"), cause=exc.cause,
                           why=exc.why)
    return compare(records["one"], records["many"], records["reordered"], records["again"])


def _check_divides(one: RunRecord, nproc: int) -> None:
    """The global batch of the 1-process run must split evenly over ``nproc`` ranks."""
    batch = one.loaders[0].get("global_batch") if one.loaders else None
    if batch and batch % nproc:
        good = [n for n in range(2, batch + 1) if batch % n == 0][:3]
        raise ConfigError(f"--nproc {nproc} does not divide the script's global batch of {batch} "
                          f"(rt.loader): pass --nproc {' or '.join(map(str, good))}")
