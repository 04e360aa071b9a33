"""``ddpkit k8s``: the Kubernetes objects that run a script with ``ddpkit run`` on N pods.

Two kinds: a Kubeflow Trainer v2 ``TrainJob`` (the ``torch-distributed`` runtime; its operator
sets ``PET_*``, which ``ddpkit run`` reads) or, on any cluster without an operator, a
``batch/v1`` Indexed Job with a headless Service (pod ``i`` is ``NAME-i.NAME``). Pure
rendering with the arguments checked; nothing here talks to a cluster.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..base.errors import ConfigError

__all__ = ["K8sJob", "render_k8s", "to_yaml", "KINDS", "DEFAULT_GRACE", "PORT", "AGENT_MARGIN"]

KINDS = ("indexed-job", "trainjob")
#: Seconds between SIGTERM (eviction, preemption, a drained node) and SIGKILL: every rank
#: finishes its step and saves a checkpoint meanwhile (ddpkit.faults.stops).
DEFAULT_GRACE = 120
#: Of the grace period, what the launcher keeps for itself after its workers' window.
AGENT_MARGIN = 10
#: The rendezvous port: Kubeflow Trainer's (ContainerTrainerPort) for both kinds.
PORT = 29500
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"^(\d+(\.\d+)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE]\d+)?$")


#: A container image reference, as the OCI distribution spec's grammar has it: an optional
#: registry host (and port), lower-case path components, an optional tag and digest.
_IMAGE = re.compile(
    r"(?:(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?/)?"                         # registry[:port]/
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"  # name
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"                    # :tag
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,})?")  # @digest

@dataclass(frozen=True)
class K8sJob:
    """What ``ddpkit k8s`` was asked for.

    Example::

        K8sJob(nodes=2, gpus_per_node=8, image="ghcr.io/me/train:1", script="train.py",
               pvc="ckpt:/ckpt")
    """

    nodes: int
    gpus_per_node: int
    image: str
    script: str
    script_args: Sequence[str] = ()
    kind: str = "indexed-job"
    name: str = "ddpkit"
    namespace: Optional[str] = None
    cpu: Optional[str] = None
    memory: Optional[str] = None
    shm_size: str = "8Gi"
    pvc: Optional[str] = None          # CLAIM:MOUNT
    grace_period: int = DEFAULT_GRACE
    max_restarts: int = 3
    runtime: str = "torch-distributed"

    def check(self) -> "K8sJob":
        """One :class:`ConfigError` line for the first thing wrong; self otherwise."""
        if self.kind not in KINDS:
            raise ConfigError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for what, value, low in (("--nodes", self.nodes, 1), ("--gpus-per-node",
                                 self.gpus_per_node, 0), ("--max-restarts", self.max_restarts, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.image, str) or not self.image.strip():
            hint = (f" (--gpus-per-node {self.gpus_per_node} needs one with CUDA and ddpkit)"
                    if self.gpus_per_node else "")
            raise ConfigError(f"--image is required: the container image with torch and ddpkit "
                              f"installed that every pod runs{hint}")
        if not _IMAGE.fullmatch(self.image):
            raise ConfigError(f"--image {self.image!r} is not a container image reference: "
                              "[REGISTRY[:PORT]/]NAME[:TAG][@sha256:DIGEST], the name in lower "
                              "case (e.g. ghcr.io/me/train:1)")
        _check_name("--name", self.name, 52)   # pods are NAME-INDEX; Job names leave room
        if self.namespace is not None:
            _check_name("--namespace", self.namespace, 63)
        if self.kind == "trainjob":
            _check_name("--runtime", self.runtime, 253)
        for flag, value in (("--cpu", self.cpu), ("--memory", self.memory),
                            ("--shm-size", self.shm_size)):
            if value is not None and not _QUANTITY.match(str(value)):
                raise ConfigError(f"{flag} {value!r} is not a Kubernetes quantity (such as 8, "
                                  "500m, 64Gi)")
        if self.memory and _bytes(self.shm_size) > _bytes(self.memory):
            raise ConfigError(f"--shm-size {self.shm_size} is larger than --memory "
                              f"{self.memory}: /dev/shm is memory the pod's limit counts")
        if isinstance(self.grace_period, bool) or not isinstance(self.grace_period, int) or \
                self.grace_period < AGENT_MARGIN + 5:
            raise ConfigError(f"--grace-period must be at least {AGENT_MARGIN + 5} s (a step, "
                              f"a checkpoint save and {AGENT_MARGIN} s for the launcher), got "
                              f"{self.grace_period!r}")
        if self.pvc is not None:
            claim, _, mount = self.pvc.partition(":")
            _check_name("--pvc CLAIM", claim, 253)
            if not mount.startswith("/"):
                raise ConfigError(f"--pvc {self.pvc!r}: give CLAIM:MOUNT, the claim's name and "
                                  "the absolute path to mount it at (e.g. ckpt:/ckpt)")
        if not isinstance(self.script, str) or not self.script.strip():
            raise ConfigError("a script is required: ddpkit k8s [flags] SCRIPT [ARGS...]")
        return self

    @property
    def nproc(self) -> int:
        """Processes per pod: one per GPU, one on a CPU pod."""
        return self.gpus_per_node or 1

    @property
    def endpoint(self) -> str:
        """Where the pods meet: pod 0's DNS name (the Trainer's ``NAME-node-0-0.NAME``)."""
        pod0 = f"{self.name}-node-0-0" if self.kind == "trainjob" else f"{self.name}-0"
        return f"{pod0}.{self.name}:{PORT}"


def _check_name(flag: str, value: Any, longest: int) -> None:
    """RFC 1123 label: what Kubernetes accepts as a name (and, for pods, a hostname)."""
    if not isinstance(value, str) or len(value) > longest or not _NAME.fullmatch(value):
        raise ConfigError(f"{flag} {value!r} is not a valid Kubernetes name: lower-case letters, "
                          f"digits and '-', starting and ending with a letter or digit, at most "
                          f"{longest} characters (RFC 1123)")


def _bytes(quantity: str) -> float:
    m = _QUANTITY.match(str(quantity))
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3}
    suffix = m.group(3) if m else None
    if suffix and suffix[0] in "eE":
        return float(m.group(1)) * 10 ** int(suffix[1:])
    return float(m.group(1)) * scale.get(suffix or "", 1) if m else 0.0


def _resources(job: K8sJob) -> Dict[str, Any]:
    limits: Dict[str, str] = {}
    if job.gpus_per_node:
        limits["nvidia.com/gpu"] = str(job.gpus_per_node)
    if job.cpu:
        limits["cpu"] = str(job.cpu)
    if job.memory:
        limits["memory"] = str(job.memory)
    return {"limits": limits, "requests": dict(limits)} if limits else {}


def _volumes(job: K8sJob) -> List[Dict[str, Any]]:
    # DataLoader workers hand batches over in /dev/shm: a container's default is 64 MiB.
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}}]
    if job.pvc:
        volumes.append({"name": "checkpoints",
                        "persistentVolumeClaim": {"claimName": job.pvc.partition(":")[0]}})
    return volumes


def _mounts(job: K8sJob) -> List[Dict[str, Any]]:
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if job.pvc:
        mounts.append({"name": "checkpoints", "mountPath": job.pvc.partition(":")[2]})
    return mounts


def _env(job: K8sJob) -> List[Dict[str, str]]:
    # The launcher gives its workers the grace period less its own margin to save and exit.
    return [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
             "value": str(job.grace_period - AGENT_MARGIN)},
            {"name": "PYTHONUNBUFFERED", "value": "1"}]


def _metadata(job: K8sJob) -> Dict[str, Any]:
    meta: Dict[str, Any] = {"name": job.name}
    if job.namespace:
        meta["namespace"] = job.namespace
    meta["labels"] = {"app.kubernetes.io/name": job.name, "app.kubernetes.io/managed-by": "ddpkit"}
    return meta


def _indexed_job(job: K8sJob) -> List[Dict[str, Any]]:
    command = ["ddpkit", "run", "--nnodes", str(job.nodes), "--nproc", str(job.nproc),
               "--node-rank", "$(JOB_COMPLETION_INDEX)", "--rdzv-endpoint", job.endpoint,
               "--rdzv-id", job.name, "--max-restarts", str(job.max_restarts),
               job.script, *job.script_args]
    container = {"name": "trainer", "image": job.image, "command": command, "env": _env(job),
                 "ports": [{"name": "rdzv", "containerPort": PORT}],
                 "volumeMounts": _mounts(job)}
    if _resources(job):
        container["resources"] = _resources(job)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(job),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {"batch.kubernetes.io/job-name": job.name},
                        "ports": [{"name": "rdzv", "port": PORT, "targetPort": PORT}]}}
    pod = {"metadata": {"labels": _metadata(job)["labels"]},
           "spec": {"subdomain": job.name, "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": job.grace_period,
                    "containers": [container], "volumes": _volumes(job)}}
    spec = {"completionMode": "Indexed", "completions": job.nodes, "parallelism": job.nodes,
            # every pod of a restart may fail once; an eviction does not count (below)
            "backoffLimit": job.nodes * max(1, job.max_restarts),
            "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [
                {"type": "DisruptionTarget", "status": "True"}]}]},
            "template": pod}
    return [service, {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job),
                      "spec": spec}]


def _trainjob(job: K8sJob) -> List[Dict[str, Any]]:
    # The operator sets PET_NNODES/NPROC_PER_NODE/NODE_RANK/MASTER_ADDR/MASTER_PORT.
    trainer: Dict[str, Any] = {
        "image": job.image, "numNodes": job.nodes, "numProcPerNode": job.nproc,
        "command": ["ddpkit", "run", "--max-restarts", str(job.max_restarts), job.script],
        "env": _env(job)}
    if job.script_args:
        trainer["args"] = list(job.script_args)
    if _resources(job):
        trainer["resourcesPerNode"] = _resources(job)
    pod = {"spec": {"terminationGracePeriodSeconds": job.grace_period,
                    "volumes": _volumes(job),
                    "containers": [{"name": "node", "volumeMounts": _mounts(job)}]}}
    patch = {"manager": "ddpkit", "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": "node", "template": {"spec": {"template": pod}}}]}}}}
    return [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": _metadata(job),
             "spec": {"runtimeRef": {"name": job.runtime}, "trainer": trainer,
                      "runtimePatches": [patch]}}]


def render_k8s(job: K8sJob) -> str:
    """The YAML for ``job`` (``kubectl apply -f`` it), after checking every argument.

    Example::

        print(render_k8s(K8sJob(2, 8, "ghcr.io/me/train:1", "train.py", ["--epochs", "10"],
                                pvc="ckpt:/ckpt")))
    """
    job.check()
    docs = _trainjob(job) if job.kind == "trainjob" else _indexed_job(job)
    head = (f"# ddpkit k8s: {job.nodes} pod(s) x {job.nproc} process(es), "
            f"{'Kubeflow Trainer TrainJob' if job.kind == 'trainjob' else 'Indexed Job'}; "
            f"pods meet at {job.endpoint}\n"
            f"# the script: {' '.join(shlex.quote(a) for a in [job.script, *job.script_args])}\n")
    return head + "---\n".join(to_yaml(doc) for doc in docs)


_PLAIN = re.compile(r"^(-+[A-Za-z]|[A-Za-z_/$])[-A-Za-z0-9_./:$()]*$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "~", "y", "n"}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _RESERVED:
        return text
    return json.dumps(text)   # a JSON string is a YAML double-quoted scalar


def to_yaml(obj: Any, indent: int = 0) -> str:
    """Block-style YAML for dicts, lists and scalars (strings quoted where YAML would read them
    as something else).

    Example::

        to_yaml({"a": [1, {"b": "on"}]})   # 'a:\\n- 1\\n- b: "on"\\n'
    """
    pad = "  " * indent
    out: List[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, (dict, list)) and value:
                out.append(f"{pad}{key}:\n" + to_yaml(value, indent + 1 if isinstance(value, dict)
                                                      else indent))
            else:
                empty = "{}" if isinstance(value, dict) else "[]" if isinstance(value, list) \
                    else _scalar(value)
                out.append(f"{pad}{key}: {empty}\n")
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                inner = to_yaml(item, indent + 1)
                out.append(f"{pad}- " + inner[len(pad) + 2:])
            else:
                out.append(f"{pad}- {_scalar(item)}\n")
    else:
        out.append(f"{pad}{_scalar(obj)}\n")
    return "".join(out)
