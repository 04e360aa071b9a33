"""What a Slurm allocation says, parsed: hostlist expansion, tasks per node, a port per job.

Everything here is a pure function of its arguments; callers read the environment. Rendering an
sbatch script is a launcher's job: :mod:`ddpkit.launchers.sbatch`.
"""
from __future__ import annotations

import itertools
import re
import zlib
from typing import List, Mapping, Optional, Union

from ..base.errors import ConfigError

__all__ = [
    "MAX_HOSTS",
    "expand_nodelist",
    "first_host",
    "port_from_job_id",
    "parse_tasks_per_node",
    "step_id",
    "step_tasks_per_node",
]

#: Upper bound on the hosts one nodelist may expand to (guards against typos like n[1-99999999]).
MAX_HOSTS = 65536

# A hostname group is a sequence of literal text and bracketed range lists,
# e.g. "rack[1-2]-node[01-02]" -> ["rack", ["1", "2"], "-node", ["01", "02"]].
_Part = Union[str, List[str]]
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(nodelist: str) -> List[str]:
    """Split ``nodelist`` on commas that are not inside brackets."""
    groups, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"bad Slurm nodelist {nodelist!r}: nested '['; use e.g. 'node[01-04,07]'")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"bad Slurm nodelist {nodelist!r}: ']' without '['; use e.g. 'node[01-04,07]'")
        elif ch == "," and depth == 0:
            groups.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"bad Slurm nodelist {nodelist!r}: unclosed '['; use e.g. 'node[01-04,07]'")
    groups.append(nodelist[start:])
    return groups


def _expand_range(item: str, nodelist: str) -> List[str]:
    """Expand one bracket item such as ``"01-04"`` or ``"7"``, keeping zero padding."""
    match = _RANGE_RE.match(item.strip())
    if not match:
        raise ConfigError(f"bad Slurm nodelist {nodelist!r}: range {item!r} is not 'N' or 'N-M'")
    lo_text, hi_text = match.group(1), match.group(2) or match.group(1)
    lo, hi = int(lo_text), int(hi_text)
    if hi < lo:
        raise ConfigError(f"bad Slurm nodelist {nodelist!r}: range {item!r} is reversed; write it as {hi}-{lo}")
    if hi - lo + 1 > MAX_HOSTS:
        raise ConfigError(f"bad Slurm nodelist {nodelist!r}: range {item!r} exceeds {MAX_HOSTS} hosts")
    width = len(lo_text)
    return [str(n).zfill(width) for n in range(lo, hi + 1)]


def _parse_group(group: str, nodelist: str) -> List[_Part]:
    """Parse one top-level group into literal text and expanded bracket lists."""
    if not group.strip():
        raise ConfigError(f"bad Slurm nodelist {nodelist!r}: empty host entry; remove the stray comma")
    parts: List[_Part] = []
    for token in re.split(r"(\[[^\]]*\])", group.strip()):
        if token.startswith("["):
            items = token[1:-1].split(",")
            parts.append([value for item in items for value in _expand_range(item, nodelist)])
        elif token:
            if any(ch.isspace() for ch in token):
                raise ConfigError(f"bad Slurm nodelist {nodelist!r}: whitespace inside host name {token!r}")
            parts.append(token)
    return parts


def _parse_nodelist(nodelist: str) -> List[List[_Part]]:
    """Validate ``nodelist`` and parse every top-level group (without the cartesian product)."""
    if not isinstance(nodelist, str) or not nodelist.strip():
        raise ConfigError(f"bad Slurm nodelist {nodelist!r}: it is empty; pass e.g. 'node[01-04]'")
    return [_parse_group(group, nodelist) for group in _split_top_level(nodelist)]


def _group_size(parts: List[_Part]) -> int:
    size = 1
    for part in parts:
        if isinstance(part, list):
            size *= len(part)
    return size


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm order.

    Zero padding is kept, several bracket ranges in one name form a cartesian
    product (leftmost range varies slowest), and duplicates are kept like
    ``scontrol show hostnames`` does.

    Example::

        >>> expand_nodelist("node[01-03,07],login1")
        ['node01', 'node02', 'node03', 'node07', 'login1']
        >>> expand_nodelist("rack[1-2]-node[01-02]")
        ['rack1-node01', 'rack1-node02', 'rack2-node01', 'rack2-node02']
    """
    groups = _parse_nodelist(nodelist)
    if sum(_group_size(parts) for parts in groups) > MAX_HOSTS:
        raise ConfigError(f"bad Slurm nodelist {nodelist!r}: expands to more than {MAX_HOSTS} hosts")
    hosts: List[str] = []
    for parts in groups:
        choices = [part if isinstance(part, list) else [part] for part in parts]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def first_host(nodelist: str) -> str:
    """Return the first host of a Slurm nodelist (the rendezvous / master address).

    The whole expression is validated but not expanded.

    Example::

        >>> first_host("gpu-[07-12],cpu3")
        'gpu-07'
    """
    parts = _parse_nodelist(nodelist)[0]
    return "".join(part[0] if isinstance(part, list) else part for part in parts)


def port_from_job_id(job_id: Union[str, int], base: int = 15000, span: int = 20000) -> int:
    """Derive a deterministic TCP port in ``[base, base + span)`` from a Slurm job id.

    Numeric ids map to ``base + id % span``; other ids (e.g. array tasks such as
    ``"1234_5"``) use ``zlib.crc32`` so every task of a job agrees on the port.

    Example::

        >>> port_from_job_id("123456")
        18456
        >>> port_from_job_id("1234_5") == port_from_job_id("1234_5")
        True
    """
    if span < 1 or base < 1 or base + span - 1 > 65535:
        raise ConfigError(f"bad port range base={base} span={span}; need 1 <= base and base + span - 1 <= 65535")
    if isinstance(job_id, bool) or not isinstance(job_id, (int, str)):
        raise ConfigError(f"bad Slurm job id {job_id!r}; pass SLURM_JOB_ID as a string or int")
    text = str(job_id).strip()
    if not text or text.startswith("-"):
        raise ConfigError(f"bad Slurm job id {job_id!r}; pass a non-empty, non-negative SLURM_JOB_ID")
    key = int(text) if text.isdigit() else zlib.crc32(text.encode("utf-8"))
    return base + key % span


def parse_tasks_per_node(value: str) -> list[int]:
    """Parse SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE into per-node task counts.

    Example::

        >>> parse_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"bad Slurm tasks-per-node value {value!r}; expected e.g. '4' or '2(x3),1'")
    counts: List[int] = []
    for item in value.split(","):
        match = _TASKS_RE.match(item.strip())
        if not match or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise ConfigError(f"bad Slurm tasks-per-node value {value!r}; expected e.g. '4' or '2(x3),1'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def step_id(environ: Mapping[str, str]) -> Optional[str]:
    """The srun step whose task this process is (``SLURM_STEP_ID``), or None: the batch script
    itself, a login shell.

    Example::

        step_id({"SLURM_STEP_ID": "0"})   # '0'
    """
    return environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or None


def step_tasks_per_node(environ: Mapping[str, str]) -> Optional[str]:
    """The tasks-per-node value that describes this process's step: the step's own
    (``srun -n 3`` on 2 nodes: ``2,1``) before the job's; None if Slurm gave none.

    Example::

        parse_tasks_per_node(step_tasks_per_node(os.environ) or "1")   # [2, 1]
    """
    return (environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
            or environ.get("SLURM_NTASKS_PER_NODE") or None)
