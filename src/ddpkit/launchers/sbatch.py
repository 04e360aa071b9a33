"""``ddpkit slurm``: an sbatch script that runs ``ddpkit run`` once per node of an allocation.

Pure text rendering with its arguments checked; nothing here talks to Slurm.
"""
from __future__ import annotations

import re
import shlex
from typing import List, Sequence

from ..base.errors import ConfigError

__all__ = ["render_sbatch", "DEFAULT_REQUEUE_GRACE", "PORT_FROM_JOB_ID"]

#: The rendezvous port on the head node unless one is given: one per job, so that jobs sharing a
#: node do not collide (the formula of :func:`ddpkit.env.slurm.port_from_job_id`).
PORT_FROM_JOB_ID = "$((15000 + SLURM_JOB_ID % 20000))"
#: Seconds between Slurm's SIGUSR1 and the end: time to finish a step and save a checkpoint.
DEFAULT_REQUEUE_GRACE = 120


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ConfigError unless ``value`` is an int in ``[low, high]``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):  # type: ignore[operator]
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigError(f"bad {name}={value!r}; it must be an integer {bound}")


def _check_directive(name: str, value: object) -> None:
    """Raise ConfigError unless ``value`` is a non-empty string without whitespace."""
    if not isinstance(value, str) or not value or any(ch.isspace() for ch in value):
        raise ConfigError(f"bad {name}={value!r}; it must be a non-empty string without spaces or newlines")


#: The time limits sbatch takes (``man sbatch``, --time): the forms named, and no limit.
_TIME_FORMS = ('"minutes"', '"minutes:seconds"', '"hours:minutes:seconds"', '"days-hours"',
               '"days-hours:minutes"', '"days-hours:minutes:seconds"')
_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:unlimited|infinite)")


def _check_time(value: object) -> None:
    """Raise ConfigError unless ``value`` is a time limit sbatch accepts; the line names its
    formats, so a typo is caught here rather than by sbatch after the script was written."""
    if not isinstance(value, str) or not _TIME.fullmatch(value):
        raise ConfigError(f"bad --time {value!r}: Slurm takes {', '.join(_TIME_FORMS[:-1])} or "
                          f"{_TIME_FORMS[-1]} (e.g. 90, 01:30:00, 2-12), or UNLIMITED")


def _check_sbatch_args(
    nodes: int, gpus_per_node: int, script: str, script_args: Sequence[str],
    cpus_per_task: int | None, port: int | None, extra_sbatch: Sequence[str],
) -> None:
    """Validate the numeric and free-text arguments of :func:`render_sbatch`."""
    _check_int("nodes", nodes, 1)
    _check_int("gpus_per_node", gpus_per_node, 0)
    if port is not None:
        _check_int("port", port, 1, 65535)
    if cpus_per_task is not None:
        _check_int("cpus_per_task", cpus_per_task, 1)
    if not isinstance(script, str) or not script.strip():
        raise ConfigError(f"bad script={script!r}; pass the path of the training script to run")
    for name, seq in (("script_args", script_args), ("extra_sbatch", extra_sbatch)):
        if isinstance(seq, str) or not all(isinstance(s, str) for s in seq):
            raise ConfigError(f"bad {name}={seq!r}; pass a list of strings")
    for line in extra_sbatch:
        if not line.strip() or "\n" in line or "\r" in line:
            raise ConfigError(f"bad extra_sbatch line {line!r}; pass one non-empty option per item, e.g. '--mem=64G'")


def _directive(line: str) -> str:
    """Turn ``"--mem=64G"`` or ``"#SBATCH --mem=64G"`` into an ``#SBATCH`` line."""
    line = line.strip()
    return line if line.startswith("#SBATCH") else f"#SBATCH {line}"


def render_sbatch(
    nodes: int,
    gpus_per_node: int,
    script: str,
    script_args: Sequence[str] = (),
    job_name: str = "ddpkit",
    time: str = "01:00:00",
    partition: str | None = None,
    cpus_per_task: int | None = None,
    port: int | None = None,
    extra_sbatch: Sequence[str] = (),
    rdzv_timeout: float | None = None,
    max_restarts: int = 0,
    requeue_grace: int | None = DEFAULT_REQUEUE_GRACE,
    min_nodes: int | None = None,
    fault_tolerant: bool = False,
) -> str:
    """Render an sbatch script running ``ddpkit run`` on ``nodes`` x ``gpus_per_node``.

    One launcher task per node; each spawns ``gpus_per_node`` workers (1 on CPU
    nodes, where ``--gres`` is omitted) and joins a c10d rendezvous on the head node, at ``port``
    (default: one per job, from its id, so that jobs sharing a node do not collide).
    ``rdzv_timeout``: seconds every node has to join; ``max_restarts``: whole-group restarts
    after a worker dies (the script resumes from its checkpoints). ``requeue_grace``: Slurm
    sends SIGUSR1 that many seconds before the time limit or a preemption; every rank finishes
    its step and saves a checkpoint (:mod:`ddpkit.faults.stops`), and the job requeues itself, to
    resume from it (``None``: no signal, no requeue). ``min_nodes``: elastic, the job goes on
    while that many nodes remain (``--no-kill``, ``--nnodes MIN:$SLURM_NNODES``; a lost node's
    task does not end the step). ``fault_tolerant``: each process a replica
    (``ddpkit run --fault-tolerant``: a lost node's replicas are left behind while the others
    keep training, and come back when the node does; the first node runs the lighthouse at
    ``port``; with ``min_nodes``, steps commit while that many nodes' replicas are alive).

    Example::

        text = render_sbatch(2, 4, "train.py", ["--epochs", "10"], partition="gpu")
        # write `text` to job.sh, then: sbatch job.sh
    """
    _check_sbatch_args(nodes, gpus_per_node, script, script_args, cpus_per_task, port, extra_sbatch)
    if rdzv_timeout is not None and (isinstance(rdzv_timeout, bool) or not
                                     isinstance(rdzv_timeout, (int, float)) or rdzv_timeout < 1):
        raise ConfigError(f"bad rdzv_timeout={rdzv_timeout!r}; it must be a number of seconds >= 1")
    _check_int("max_restarts", max_restarts, 0)
    if min_nodes is not None:
        _check_int("min_nodes", min_nodes, 1)
        if min_nodes >= nodes:
            raise ConfigError(f"--min-nodes {min_nodes} must be smaller than --nodes {nodes} "
                              "(the job goes on while at least that many nodes remain)")
    if requeue_grace is not None:
        _check_int("requeue_grace", requeue_grace, 1)
    _check_directive("job_name", job_name)
    _check_time(time)
    if partition is not None:
        _check_directive("partition", partition)
    nproc = gpus_per_node or 1
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={time}",
    ]
    lines += [f"#SBATCH --gres=gpu:{gpus_per_node}"] if gpus_per_node else []
    lines += [f"#SBATCH --cpus-per-task={cpus_per_task}"] if cpus_per_task is not None else []
    lines += [f"#SBATCH --partition={partition}"] if partition is not None else []
    if requeue_grace is not None:  # B: only the batch shell gets it; it tells the step below
        # append: a requeued run adds to the log instead of replacing the preempted one's.
        lines += [f"#SBATCH --signal=B:USR1@{requeue_grace}", "#SBATCH --requeue",
                  "#SBATCH --open-mode=append"]
    if min_nodes is not None or fault_tolerant:  # a node that fails does not end the allocation
        lines += ["#SBATCH --no-kill"]
    lines += [_directive(line) for line in extra_sbatch]
    command = " ".join(shlex.quote(arg) for arg in [script, *script_args])
    options = (f" --rdzv-timeout {rdzv_timeout:g}" if rdzv_timeout is not None else "") + \
        (f" --max-restarts {max_restarts}" if max_restarts else "")
    lines += [
        "",
        "set -euo pipefail",
        "",
        "# First allocated host runs the c10d rendezvous store (sed reads all input: no SIGPIPE under pipefail).",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        *(["# One port per job: jobs that share a node do not collide.",
           f"port={PORT_FROM_JOB_ID}"] if port is None else [f"port={port}"]),
        "",
        "# One launcher per node; node ranks come from the rendezvous (or from Slurm).",
    ]
    # elastic: a lost node's task leaves the others running; they go on with the nodes left
    launch = ("srun ddpkit run --nnodes \"$SLURM_NNODES\"" if min_nodes is None else
              f"srun --no-kill --kill-on-bad-exit=0 ddpkit run --nnodes {min_nodes}:\"$SLURM_NNODES\"")
    srun = (f'{launch} --nproc {nproc} '
            f'--rdzv-endpoint "$head_node:$port" --rdzv-id "$SLURM_JOB_ID"{options} {command}')
    if fault_tolerant:  # no rendezvous: the lighthouse on the first node keeps the quorum
        least = f" --min-replicas {min_nodes * nproc}" if min_nodes is not None else ""
        srun = ('srun --no-kill --kill-on-bad-exit=0 ddpkit run --fault-tolerant --nnodes '
                f'"$SLURM_NNODES" --nproc {nproc} --lighthouse "$head_node:$port"{least}'
                f'{options} {command}')
    lines += [srun] if requeue_grace is None else _requeue(srun, requeue_grace)
    return "\n".join(lines) + "\n"


def _requeue(srun: str, grace: int) -> List[str]:
    """The step in the background under a SIGUSR1 trap: the ranks checkpoint and stop with 138
    (128 + SIGUSR1), then the job goes back to the queue; any other end keeps its status."""
    return [
        "# SIGUSR1 (see --signal above) goes to every rank: each finishes its step, saves a",
        "# checkpoint and stops with 138; then the job requeues and resumes from it. The agent",
        "# gives the ranks this long before it kills them.",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={max(30, grace - 30)}",
        'step="" preempted=0 rc=0',
        'trap \'preempted=1; kill -USR1 "$step" 2>/dev/null || true\' USR1',
        f"{srun} &",
        "step=$!",
        'wait "$step" || rc=$?',
        'if [ "$preempted" = 1 ]; then rc=0; wait "$step" || rc=$?; fi',
        'if [ "$rc" = 138 ]; then scontrol requeue "$SLURM_JOB_ID"; exit 0; fi',
        'exit "$rc"',
    ]
