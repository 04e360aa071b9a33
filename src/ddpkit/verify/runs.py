"""Running the user's unchanged script for ``ddpkit verify``: on 1 process (twice, and once with
every batch reversed) and on N, each as ``ddpkit run`` runs it (a free port, the cores split),
with ``ddpkit.setup()`` recording every optimizer step (``ddpkit.verify.probe``). The first
1-process run sets the limits; the other three are independent and run side by side. Each is
forked from verify's own fork server (:class:`ddpkit.launchers.forked.Forked`: torch imported
once for the four, the script run as ``python -u`` runs it), the N-process one through ``ddpkit
run``.

Each run works in a directory of its own (:func:`working_directory`): what the script writes
under a relative path (``model.pt``, ``checkpoints/``) stays in that run, so no run resumes from
another and nothing is left for the user's next real run. The runs read no standard input and
end with verify (a Ctrl-C, SIGTERM, or ``kill -9`` of verify itself).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from ..base.errors import ConfigError
from ..launchers.forked import Forked
from ..base.observe import OBSERVER_VAR
from .probe import ACCUM_VAR, EVAL_VAR, ORDER_VAR, STEPS_VAR, VERIFY_VAR
from .compare import Verdict, compare
from .records import RunRecord, load

__all__ = ["verify", "run_script", "side_by_side", "PLAN"]

#: The runs, in the order their outcomes are read: name, processes, batches reversed.
PLAN = (("one", 1, False), ("many", None, False), ("reordered", 1, True), ("again", 1, False))
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")
# DDP's own words when a parameter got no gradient on some rank
_UNUSED = ("Expected to have finished reduction", "did not receive grad")
_LIVE: set = set()  # the runs' processes now running (a Ctrl-C ends every one)
_LIVE_LOCK = threading.Lock()


class Diverged(Exception):
    """A run failed in a way that is itself the answer (DDP's unused-parameter error)."""

    def __init__(self, cause: str, why: str, evidence: Sequence[str] = ()) -> None:
        super().__init__(why)
        self.cause, self.why, self.evidence = cause, why, list(evidence)


class PastEpoch(ConfigError):
    """More steps asked than the 1-process epoch has: ``limit`` steps compare alike; ``record``
    is the run, which went on past them (its first ``limit`` steps are those of a shorter
    run)."""

    def __init__(self, message: str, record: RunRecord, limit: int, epoch: str) -> None:
        super().__init__(message)
        self.record, self.limit, self.epoch = record, limit, epoch


class RunFailed(ConfigError):
    """A run that failed or hung: ``hung`` for a timeout; ``said`` is its own last word."""

    def __init__(self, message: str, said: str, hung: bool = False) -> None:
        super().__init__(message)
        self.said, self.hung = said, hung


def run_script(script: str, args: Sequence[str], nproc: int, steps: int, directory: str,
               reverse: bool = False, timeout: Optional[float] = None,
               whole_epoch: bool = True, accum: int = 1, nproc_many: int = 2,
               eval_within: int = 0) -> RunRecord:
    """Run ``script`` on ``nproc`` processes recording ``steps`` optimizer steps into
    ``directory`` (then up to ``eval_within`` more until its first evaluation has ended); one
    :class:`ConfigError` line when it fails or, on 1 process, records nothing. On N
    processes fewer steps than asked are the comparison's business (a FAIL), not an error.

    Example::

        run_script("train.py", ["--epochs", "1"], 2, 10, "/tmp/verify/many")
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update({OBSERVER_VAR: "ddpkit.verify.probe", VERIFY_VAR: directory,
                STEPS_VAR: str(steps), "PYTHONUNBUFFERED": "1"})
    if reverse:
        env[ORDER_VAR] = "reverse"
    if eval_within > 0:
        env[EVAL_VAR] = str(eval_within)
    if nproc == 1 and accum > 1:
        env[ACCUM_VAR] = str(accum)
    if nproc > 1:
        env.setdefault("TORCH_DISTRIBUTED_DEBUG", "INFO")  # DDP names unused parameters
    # One process needs no launcher (setup() runs it as a job of 1 on every core, as `ddpkit
    # run --nproc 1` would); N processes run as `ddpkit run` runs them.
    launch = [sys.executable, "-m", "ddpkit", "run", "--nproc", str(nproc)] if nproc > 1 else \
        [sys.executable]
    proc = _run([*launch, os.path.abspath(script), *args], env, timeout,
                f"{script} on {nproc} process(es)", working_directory(directory))
    record = load(directory)
    if proc.returncode != 0 and any(marker in proc.stderr for marker in _UNUSED):
        said = next(line.strip() for line in proc.stderr.splitlines()
                    if any(marker in line for marker in _UNUSED))
        raise Diverged("unused-parameters", f"on {nproc} processes some parameters got no "
                                            "gradient on some ranks, and DDP stopped waiting "
                                            "for them (unused parameters): make every rank use "
                                            "every parameter in its forward, or wrap with "
                                            "find_unused_parameters=True",
                       [f"DDP on {nproc} processes: {said[:300]}"])
    if proc.returncode != 0:
        message = _failed(script, nproc, proc.stderr, record)
        raise RunFailed(message, message.split(": ", 1)[-1])
    if nproc > 1 and record.started:
        return record
    return _checked(script, record, steps, whole_epoch, nproc_many, accum if nproc == 1 else 1)


def working_directory(directory: str, here: Optional[str] = None) -> str:
    """A run's own working directory, ``directory/cwd``: a link to every entry of ``here`` (the
    user's working directory), so the script reads its data and code by relative paths as it
    would; what it creates there (outputs, checkpoints, ``model.pt``) is the run's alone.

    Example::

        working_directory("/tmp/ddpkit-verify-x/one")   # '/tmp/ddpkit-verify-x/one/cwd'
    """
    here = os.getcwd() if here is None else here
    cwd = os.path.join(directory, "cwd")
    os.makedirs(cwd, exist_ok=True)
    with contextlib.suppress(OSError):
        for name in os.listdir(here):
            with contextlib.suppress(OSError):
                os.symlink(os.path.join(here, name), os.path.join(cwd, name))
    return cwd


def _die_with_verify() -> None:  # in the child, before exec: verify's kill -9 ends the run too
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _run(command: list, env: dict, timeout: Optional[float], what: str,
         cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own, with no standard input (a script asking for
    input fails at once, as under a scheduler); past ``timeout`` kill all of it (the launcher
    and its ranks) and say so in one line."""
    if command[:1] == [sys.executable] and sys.platform.startswith("linux"):
        # forked from verify's own server, which imported torch once for the four runs
        proc: Any = Forked(command[1:], env=env, cwd=cwd)
    else:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True, cwd=cwd, preexec_fn=_die_with_verify
                                if sys.platform.startswith("linux") else None)
    with _LIVE_LOCK:
        _LIVE.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)
        raise RunFailed(f"{what} ran past {timeout:g} s without recording its steps: does it "
                        "wait for input or hang? Run it with ddpkit run to see",
                        f"still running after {timeout:g} s", hung=True) from None
    except BaseException:  # Ctrl-C: the runs go with verify
        _kill(proc)
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _kill(proc: Any) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its session: a launcher and its ranks
    if isinstance(proc, Forked):
        proc.kill()  # before its own session began


def side_by_side(runs: Sequence[Callable[[], Any]]) -> List[Tuple[Any, Optional[BaseException]]]:
    """Each of ``runs`` in a thread of its own, at once; (result, None) or (None, its error) for
    each, in order. A Ctrl-C (or any error here) ends every run's processes, then raises.

    Example::

        [(many, _), (again, error)] = side_by_side([lambda: run("many"), lambda: run("again")])
    """
    def caught(run: Callable[[], Any]) -> Tuple[Any, Optional[BaseException]]:
        try:
            return run(), None
        except Exception as exc:  # noqa: BLE001 - read in order by the caller
            return None, exc
    pool = ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="ddpkit-verify-run")
    try:
        futures = [pool.submit(caught, run) for run in runs]
        for done in as_completed(futures):
            done.result()  # a BaseException in a run (not its error): at once, not in turn
        return [f.result() for f in futures]
    except BaseException:
        with _LIVE_LOCK:
            for proc in list(_LIVE):
                _kill(proc)
        raise
    finally:
        pool.shutdown(wait=True)


def _failed(script: str, nproc: int, stderr: str, record: RunRecord) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("error:")), None) or \
        _rank_error(lines) or \
        next((line for line in reversed(lines) if not line.startswith("ddpkit run:")), "")
    said = said.strip()
    said = said[len("error:"):].strip() if said.startswith("error:") else said
    where = f"after {len(record.steps)} recorded step(s)" if record.started else "at start-up"
    line = _script_line(lines)
    return (f"{script} failed on {nproc} process(es) {where}: {said.strip()[:300]}"
            + (f" (at {line})" if line and line not in said else ""))


def _script_line(lines: Sequence[str]) -> Optional[str]:
    """``file:line`` of the traceback's last frame in the user's code (not Python's, torch's or
    ddpkit's own), or None."""
    found = None
    for line in lines:
        m = re.search(r'File "([^"]+)", line (\d+)', line)
        if m and not any(part in m.group(1) for part in ("site-packages", "/lib/python",
                                                        os.sep + "ddpkit" + os.sep, "<frozen")):
            found = f"{os.path.basename(m.group(1))}:{m.group(2)}"
    return found


def _rank_error(lines: Sequence[str]) -> Optional[str]:
    """The first failing rank's own last word: its exception line, not ``Traceback (most recent
    call last):`` nor a frame of it."""
    first = next((line.split("]", 1)[0] + "]" for line in lines if line.startswith("[rank")), None)
    if first is None:
        return None
    said = [line[len(first):] for line in lines if line.startswith(first)]
    said = [line.strip() for line in said if line.strip() and not line[1:2].isspace()
            and not line.strip().startswith(("Traceback (most recent call last)", "^", "~"))]
    return f"{first} {said[-1]}" if said else None


def _checked(script: str, record: RunRecord, steps: int, whole_epoch: bool, nproc: int = 2,
             accum: int = 1) -> RunRecord:
    if not record.started:
        raise ConfigError(f"{script} never called ddpkit.setup(): verify watches ddpkit "
                          "scripts; add `rt = ddpkit.setup()` (and rt.wrap, rt.loader) first")
    if not record.steps and not record.models:
        raise ConfigError(f"{script} ran to the end without an optimizer step of a model "
                          "wrapped by rt.wrap: nothing to compare; wrap the model the script "
                          "trains (model = rt.wrap(model))")
    if not record.steps:
        raise ConfigError(f"{script} ran to the end without an optimizer step: nothing to "
                          "compare; verify a script that trains")
    ends = [s.step for s in record.steps if s.epoch_end]
    if whole_epoch and ends:  # the 1-process epoch sets the limit
        limit, why = _epoch_limit(ends[0], record.loaders[0] if record.loaders else {}, nproc,
                                  accum)
        if steps > limit:
            advice = f"pass --steps {limit} or less" if limit else "give it more samples"
            seen = f" (before it, {_passes(record.untrained)} that trained on nothing, not " \
                "counted)" if record.untrained else ""
            raise PastEpoch(f"--steps {steps} goes past the script's first training epoch "
                            f"over its rt.loader: {ends[0]} optimizer steps{why}{seen}; "
                            f"{advice}", record, limit, f"{ends[0]} optimizer steps{why}")
    if len(record.steps) < steps:
        raise ConfigError(f"{script} ended after {len(record.steps)} optimizer step(s), fewer "
                          f"than --steps {steps} on {record.world_size} process(es); pass "
                          f"--steps {len(record.steps)} or less")
    return record


def _passes(batches: Sequence[int]) -> str:
    return (f"a pass of {batches[0]} batch(es)" if len(batches) == 1 else
            f"{len(batches)} passes of {', '.join(map(str, batches))} batches")


def _epoch_limit(steps: int, loader: dict, nproc: int, accum: int) -> Tuple[int, str]:
    """The steps of an epoch that N processes take alike, and why the last one is left out."""
    samples, batch = loader.get("samples", 0), max(loader.get("global_batch") or 1, 1)
    if loader.get("drop_last") or not samples:
        return steps, ""
    if samples % nproc:
        return steps - 1, (f", and its last step is padded on {nproc} processes ({samples} "
                           f"samples do not split evenly)")
    if accum > 1 and samples % batch:
        return steps - 1, ", and its last step is short: uneven micro-batches for --accum-steps"
    return steps, ""


def verify(script: str, args: Sequence[str] = (), nproc: int = 2, steps: Optional[int] = None,
           workdir: Optional[str] = None, timeout: Optional[float] = 900,
           accum: Optional[int] = None, eval_within: int = 200) -> Verdict:
    """Run ``script`` on 1 and on ``nproc`` processes and compare them step by step; with
    ``accum`` K > 1 the 1-process runs accumulate K micro-batches per step, the batches of K
    ranks (with K = ``nproc``, each micro-batch is one rank's: BatchNorm sees the same batches).
    The 1- and N-process runs train on for up to ``eval_within`` more steps to reach the
    script's first evaluation, whose samples and printed metrics are compared too. With
    ``accum`` None (the default), a model with BatchNorm layers that are not synced is
    compared with K = ``nproc`` (each rank normalises its own batch, by design), when its batch
    splits so; ``accum=1`` compares it as it is.

    Example::

        verdict = verify("examples/train_ddpkit.py", ["--epochs", "1"], nproc=2, steps=10)
        verdict.passed
    """
    asked, steps = steps, DEFAULT_STEPS if steps is None else steps  # default: <= an epoch
    if nproc < 2:
        raise ConfigError(f"--nproc must be >= 2 to compare with one process, got {nproc}")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    auto, accum = accum is None, accum or 1
    if accum < 1:
        raise ConfigError(f"--accum-steps must be >= 1, got {accum}")
    if eval_within < 0:
        raise ConfigError(f"--eval-within must be >= 0 steps, got {eval_within}")
    records = {}
    with tempfile.TemporaryDirectory(prefix="ddpkit-verify-", dir=workdir) as tmp, \
            _stopped_by_sigterm():
        def run(name: str, n: Optional[int], reverse: bool) -> RunRecord:
            return run_script(script, args, n or nproc, steps, os.path.join(tmp, name), reverse,
                              timeout, whole_epoch=name.startswith("one"), accum=accum,
                              nproc_many=nproc,
                              eval_within=eval_within if name != "reordered" else 0)
        try:
            records["one"], steps, shorter = _first(lambda: run(*PLAN[0]), steps, asked)
            _check_divides(records["one"], nproc)  # before a rerun that splits the batch N ways
            if auto and _batchnorms(records["one"]):  # compare the micro-batches the ranks take
                try:
                    accum, first = nproc, records["one"]
                    records["one"], steps, _ = _first(lambda: run("one-accumulating", 1, False),
                                                      steps, asked)
                except RunFailed:
                    raise
                except ConfigError:  # the batch does not split, an optimizer made too early
                    accum, records["one"] = 1, first
            rest = side_by_side([lambda plan=plan: run(*plan) for plan in PLAN[1:]])
            for (name, _, _), (record, error) in zip(PLAN[1:], rest):
                if error is not None:  # the first in PLAN's order, as if run one by one
                    raise error
                records[name] = record
        except Diverged as exc:
            return Verdict(passed=False, steps=[], largest=None, cause=exc.cause, why=exc.why,
                           evidence=exc.evidence)
        except RunFailed as exc:
            if "one" not in records or "many" in records:  # 1 process fails too: no comparison
                raise
            return _fails_on_n(records["one"], nproc, exc)
    verdict = compare(records["one"], records["many"], records["reordered"], records["again"],
                      steps, eval_within)
    verdict.accum = accum
    if shorter:
        verdict.notes.append(f"--steps {DEFAULT_STEPS} (the default) is past the script's first "
                             f"epoch ({shorter}): {steps} compared; pass --steps to choose")
    if auto and accum > 1:
        verdict.notes.append(f"BatchNorm: {_batchnorms(records['one'])} layer(s) normalise each "
                             f"rank's batch, so 1 process accumulated {accum} micro-batches, the "
                             f"{accum} ranks' batches, a step (--accum-steps 1 compares without)")
    return verdict


#: Optimizer steps compared when ``--steps`` is not given (fewer when the epoch is shorter).
DEFAULT_STEPS = 10


def _first(run: Callable[[], RunRecord], steps: int,
           asked: Optional[int]) -> Tuple[RunRecord, int, str]:
    """The 1-process run that sets the limits, the steps to compare, and the epoch that cut
    them ('' when none did): past its epoch, steps the user did not ask for are cut to it."""
    try:
        return run(), steps, ""
    except PastEpoch as exc:
        if asked is not None or exc.limit < 1:
            raise
        exc.record.steps = exc.record.steps[:exc.limit]
        return exc.record, exc.limit, exc.epoch


def _batchnorms(record: RunRecord) -> int:
    """BatchNorm layers (not synced) in the run's wrapped models."""
    return max((m.get("batchnorms", 0) for m in record.models), default=0)


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM to verify (a scheduler's stop, ``kill``) ends its runs as a Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)
    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _fails_on_n(one: RunRecord, nproc: int, exc: RunFailed) -> Verdict:
    """1 process trains, N fail or hang: the divergence is the verdict, not a usage error."""
    what = "hangs" if exc.hung else "fails"
    hint = ("a collective that not every rank reaches (under `if rank == 0:`), or ranks with "
            "different numbers of batches" if exc.hung else
            "code that only runs distributed (a collective, a rank-dependent shape)")
    return Verdict(passed=False, steps=[], largest=None, cause=f"{what}-on-n",
                   why=f"the script {what} on {nproc} processes where 1 process trains "
                       f"{len(one.steps)} steps: look at {hint}",
                   evidence=[f"1 process: {len(one.steps)} optimizer steps recorded",
                             f"{nproc} processes: {exc.said[:300]}"])


def _check_divides(one: RunRecord, nproc: int) -> None:
    """The global batch of the 1-process run must split evenly over ``nproc`` ranks and the
    script's own accumulation steps (``loader.batch``, as rt.loader recorded it)."""
    record = one.loaders[0] if one.loaders else {}
    batch = record.get("global_batch")
    # the script's own steps: a 1-process run of --accum-steps K took K times as many
    unit = max((record.get("batch") or {}).get("accum_steps", 1)
               // max(record.get("micro_steps", 1), 1), 1)
    if batch and batch % (nproc * unit):
        good = [n for n in range(2, batch + 1) if batch % (n * unit) == 0][:3]
        of = f" in {unit} accumulation steps" if unit > 1 else ""
        raise ConfigError(f"--nproc {nproc} does not divide the script's global batch of {batch}"
                          f"{of} (rt.loader): pass --nproc {' or '.join(map(str, good)) or 1}")
