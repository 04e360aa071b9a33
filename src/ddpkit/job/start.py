"""How ``ddpkit train`` runs a job: check it, write the resolved config into the run directory,
then train in this process, or start the workers under torchrun or horovodrun.

:func:`start` is the library form of ``ddpkit train``: ``start(cfg)`` from Python does what the
command does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from typing import Iterator, List, Mapping, Optional, Union

import torch

from ..checkpoint.files import resume_order
from ..checkpoint.write import RESUME_COMMAND_VAR
from ..faults.crash import LAUNCHER_PID_VAR
from ..engines import create as create_engine
from ..env.detect import detect
from ..base.errors import ConfigError
from ..launchers import horovodrun
from ..launchers.capacity import check_memory
from ..launchers.srun import step_task
from ..launchers.torchrun import RunConfig, run
from .check import check_config, check_every_world, check_resume, known_train_size
from ..env.dist import check_gpu_sharing
from .config import TrainConfig, parse_nproc
from .previous import claim_output
from .rundir import hold_run_dir

__all__ = ["start", "plan", "job_nproc", "resume_hint", "inside_a_launcher", "WORKER"]

#: The worker module every rank runs: ``python -m ddpkit.job.train CONFIG.json``.
WORKER = "ddpkit.job.train"


def job_nproc(nproc: Union[int, str], gpus: int) -> int:
    """Processes on this node for ``ddpkit train``: ``auto`` is one per GPU, and 2 without GPUs
    (1 on a one-core machine): on CPU more processes only split the same cores.

    Example::

        job_nproc("auto", gpus=8), job_nproc("auto", gpus=0), job_nproc(3, gpus=0)   # 8, 2, 3
    """
    value = parse_nproc(nproc)
    if value != "auto":
        return int(value)
    return gpus or min(2, os.cpu_count() or 1)


#: Words of a torchrun agent's command line (``torchrun``, ``python -m torch.distributed.run``,
#: ``torch.distributed.launch``); ``ddpkit run``'s agent runs in-process and says its pid.
_AGENTS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def inside_a_launcher(environ: Mapping[str, str], parent: Optional[List[str]] = None) -> bool:
    """Whether this process is one worker of a launcher (then ``ddpkit train`` trains here as
    that rank) rather than the launcher itself: ``RANK`` and ``WORLD_SIZE`` are set *and* a
    launcher stands behind them. torchrun's mark (``TORCHELASTIC_RUN_ID``) counts only when the
    parent process is its agent (``parent``: its arguments, read from /proc by default; or
    ``ddpkit run``, whose pid the workers get): the variables of an outer job left in a shell are
    ignored, with a note, not waited on.

    Example::

        inside_a_launcher({"RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "old"},
                          parent=["-bash"])   # False: a shell, not torchrun's agent
    """
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return False
    if environ.get("TORCHELASTIC_RUN_ID"):
        args = _parent_args() if parent is None else parent
        inside = args is None or environ.get(LAUNCHER_PID_VAR) == str(os.getppid()) or \
            any(os.path.basename(a) in _AGENTS or a in _AGENTS for a in args[:3])
    else:  # MPI, ddpkit.launch, a Kubernetes pod, a Slurm step; nothing: stale variables
        inside = detect(environ).vouched
    if not inside:
        stale = " ".join(f"{k}={environ[k]}" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                        "MASTER_ADDR", "MASTER_PORT",
                                                        "TORCHELASTIC_RUN_ID") if k in environ)
        print(f"note: ignoring {stale}: no launcher started this process (left from another "
              "job?); ddpkit train launches its own processes", file=sys.stderr, flush=True)
    return inside


def _parent_args() -> Optional[List[str]]:
    """The parent process's arguments, or None where /proc cannot say (not Linux)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return None


def plan(cfg: TrainConfig, launch: RunConfig, inside_launcher: bool) -> str:
    """Where the job runs: ``"here"`` (this process), ``"torchrun"`` or ``"horovodrun"``.

    Example::

        plan(TrainConfig(nproc=1), RunConfig(WORKER), inside_launcher=False)   # 'here'
    """
    if inside_launcher:
        return "here"  # already one worker of a launcher: torchrun, srun + torchrun
    if cfg.nproc == 1 and launch.nnodes == 1 and not launch.restarts:
        return "here"
    return create_engine(cfg.engine).launcher


def start(cfg: TrainConfig, launch: Optional[RunConfig] = None, overwrite: bool = False) -> int:
    """Check ``cfg``, save it to ``cfg.output/config.json`` and run the job; the exit status.

    ``launch`` carries the launch flags (nodes, rendezvous, restarts); its script is replaced
    by the job's worker. With restarts the job resumes from its own checkpoints. An
    ``output`` that holds an earlier run is refused unless ``cfg.resume`` continues it or
    ``overwrite`` deletes it first (:func:`ddpkit.job.previous.claim_output`).

    Example::

        start(TrainConfig(epochs=2, output="runs/quick"))   # one process per GPU (2 on CPU)
    """
    launch = launch or RunConfig(WORKER)
    if overwrite and cfg.resume:  # before the implied resume of restarts below
        claim_output(cfg.output, cfg.resume, overwrite)
    # a restarted worker must pick up its work; an elastic group also restarts to grow
    if (launch.restarts or launch.elastic or launch.fault_tolerant) and not cfg.resume:
        cfg = dataclasses.replace(cfg, resume="auto")
    inside = inside_a_launcher(os.environ)
    gpus = torch.cuda.device_count() if cfg.accelerator != "cpu" else 0
    if cfg.accelerator == "cuda" and not gpus:
        raise ConfigError("--accelerator cuda: no CUDA device is visible here; use "
                          "--accelerator cpu (or auto), or check CUDA_VISIBLE_DEVICES")
    one_process = cfg.engine in ("dp", "none") and cfg.nproc == "auto"  # dp: 1 over all GPUs
    cfg = dataclasses.replace(cfg, nproc=1 if one_process else job_nproc(cfg.nproc, gpus))
    if gpus and not inside:
        check_gpu_sharing(cfg.nproc, gpus, cfg.backend)
    if not inside:  # before the run directory is written (the launcher says the cores' warning)
        check_memory(cfg.nproc)
    # fault-tolerant: each replica a job of one, the step's batch split over the live ones
    world = detect(os.environ).world_size if inside or launch.fault_tolerant else \
        cfg.nproc * launch.nnodes
    if launch.elastic and not inside and not cfg.eval_only:  # MIN nodes: same global batch
        check_every_world(cfg, cfg.nproc, launch.min_nodes or 1, launch.nnodes,
                          known_train_size(cfg))
    check_config(cfg, world, gpus > 0, known_train_size(cfg))
    check_resume(cfg)  # before the run directory's config is replaced
    if cfg.eval_only:  # reads a checkpoint, writes nothing: no lock, the config in a temp file
        with tempfile.TemporaryDirectory(prefix="ddpkit-eval-") as tmp:
            path = os.path.join(tmp, "config.json")
            cfg.dump(path)
            return _launch(cfg, launch, inside, path)
    # One run per directory: refused while another holds it, held through restarts.
    owner = _holds_lock(launch, inside)
    with hold_run_dir(cfg.output, lock=owner):
        if owner or not overwrite:  # one process deletes; the others take what it leaves
            claim_output(cfg.output, cfg.resume, overwrite and owner)
        path = _save(cfg)
        with _resume_command(f"ddpkit train --config {path} --resume auto"):
            return _launch(cfg, launch, inside, path)


def _launch(cfg: TrainConfig, launch: RunConfig, inside: bool, path: str) -> int:
    where = plan(cfg, launch, inside)
    if where == "here":
        from .train import train  # the workers' module: imported where it runs

        train(cfg)
        return 0
    if where == "horovodrun":
        if launch.nnodes != 1 or launch.restarts:
            raise ConfigError("--engine horovod runs on one node without restarts from `ddpkit "
                              f"train`; for several hosts run `horovodrun -H ... python -m {WORKER} "
                              f"{path}` yourself")
        return horovodrun.run(cfg.nproc, [sys.executable, "-m", WORKER, path])
    hint = None if cfg.eval_only else lambda: resume_hint(cfg, path)
    stop = None if hint is None else lambda signum: hint()
    return run(dataclasses.replace(launch, script=WORKER, module=True, script_args=[path],
                                   nproc=cfg.nproc, on_stop=stop, on_give_up=hint))


def resume_hint(cfg: TrainConfig, config_path: str) -> str:
    """After a stop, or once the restarts are used up: where the newest checkpoint is and the
    command that continues the run.

    Example::

        resume_hint(cfg, "runs/demo/config.json")
        # '; last checkpoint runs/demo/checkpoints/ckpt-000000120.pt: continue with ...'
    """
    directory = os.path.join(cfg.output, "checkpoints")
    found = resume_order(directory)
    again = f"ddpkit train --config {config_path} --resume auto"
    # a save the stop cut short (the workers killed at the launcher's deadline) left its
    # temporary file: say it was not kept, and which one the resume takes instead
    cut = sorted(name[:-4] for name in (os.listdir(directory) if os.path.isdir(directory) else ())
                 if name.startswith("ckpt-") and name.endswith(".pt.tmp"))
    unfinished = f"; {cut[-1]} was being written and is not kept" if cut else ""
    if not found:
        return f"{unfinished}; no checkpoint yet: `{again}` starts it afresh"
    return f"{unfinished}; last checkpoint {found[0]}: continue with `{again}`"


def _save(cfg: TrainConfig) -> str:
    path = os.path.join(cfg.output, "config.json")
    try:
        cfg.dump(path)
    except OSError as exc:  # read-only file system, no permission, disk full
        raise ConfigError(f"cannot write the run directory {cfg.output} "
                          f"({exc.strerror or exc}); choose a writable --output") from None
    pretty = "\n".join(f"  {k}: {v}" for k, v in cfg.to_dict().items())
    print(f"resolved config (saved to {path}):\n{pretty}", flush=True)
    return path


@contextlib.contextmanager
def _resume_command(command: str) -> Iterator[None]:
    # For the workers' error lines (a full disk): the command that continues this run.
    previous = os.environ.get(RESUME_COMMAND_VAR)
    os.environ[RESUME_COMMAND_VAR] = command
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RESUME_COMMAND_VAR, None)
        else:
            os.environ[RESUME_COMMAND_VAR] = previous


def _holds_lock(launch: RunConfig, inside: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process locks the run directory: exactly one process per job, or none.

    Workers of an outside launcher each run this: rank 0 locks. On one node: this launcher.
    On several: node 0's launcher (srun task 0, or ``--node-rank 0``); with a c10d endpoint and
    no srun no node knows it is first, so none locks (the others would refuse their own job).
    """
    if inside:
        return environ.get("RANK") == "0"
    if launch.nnodes == 1:
        return True
    task = step_task(environ)
    if task is not None:
        return task == 0
    return not launch.rdzv_endpoint and launch.node_rank == 0
