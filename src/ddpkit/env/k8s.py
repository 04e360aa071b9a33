"""Kubernetes pods: where a process sits in the job, from what the pod was given.

Kubeflow Trainer's torch runtime sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` (the variables torchrun reads as its flags'
defaults; kubeflow/trainer ``pkg/runtime/framework/plugins/torch/torch.go``); an Indexed Job
gives ``JOB_COMPLETION_INDEX``. A pure function of a mapping, like :mod:`ddpkit.env.detect`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ..base.errors import ConfigError

__all__ = ["PodLaunch", "pod_launch", "PET_VARS"]

#: The variables Kubeflow Trainer's torch plugin sets in every trainer container.
PET_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
            "PET_MASTER_PORT")


@dataclass(frozen=True)
class PodLaunch:
    """What a pod says about the launch: ``None`` where it says nothing.

    Example::

        pod = pod_launch({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "j-node-0-0.j",
                          "PET_MASTER_PORT": "29500", "PET_NPROC_PER_NODE": "1"})
        assert pod.node_rank == 1 and pod.endpoint == "j-node-0-0.j:29500"
    """

    nnodes: Optional[str] = None       # "2", or "1:4" as torchrun reads it
    nproc: Optional[str] = None        # "4", or torchrun's "auto" / "gpu" / "cpu"
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    #: Which variables said so: ``PET_*`` or ``JOB_COMPLETION_INDEX``.
    source: str = ""

    @property
    def endpoint(self) -> Optional[str]:
        """``MASTER_ADDR:MASTER_PORT`` when the pod names both (the rendezvous point)."""
        if self.master_addr and self.master_port is not None:
            return f"{self.master_addr}:{self.master_port}"
        return None


def _int(environ: Mapping[str, str], key: str) -> Optional[int]:
    raw = environ.get(key, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {key}={raw!r} is not an integer (set by the "
                          "pod's manifest or its operator)") from None
    if value < 0:
        raise ConfigError(f"environment variable {key}={raw!r} must be >= 0")
    return value


def pod_launch(environ: Mapping[str, str]) -> Optional[PodLaunch]:
    """The launch a pod describes, or None outside one (no ``PET_*``, no
    ``JOB_COMPLETION_INDEX``). ``PET_*`` win; an Indexed Job's index is the node rank.

    Example::

        pod_launch({"JOB_COMPLETION_INDEX": "3"}).node_rank   # 3
    """
    if any(environ.get(k) for k in PET_VARS):
        rank = _int(environ, "PET_NODE_RANK")
        return PodLaunch(nnodes=environ.get("PET_NNODES") or None,
                         nproc=environ.get("PET_NPROC_PER_NODE") or None,
                         node_rank=rank if rank is not None else _int(environ,
                                                                      "JOB_COMPLETION_INDEX"),
                         master_addr=environ.get("PET_MASTER_ADDR") or None,
                         master_port=_int(environ, "PET_MASTER_PORT"), source="PET_*")
    index = _int(environ, "JOB_COMPLETION_INDEX")
    if index is None:
        return None
    return PodLaunch(node_rank=index, source="JOB_COMPLETION_INDEX")
