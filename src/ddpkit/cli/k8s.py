"""``ddpkit k8s``: print the Kubernetes objects that run a script with ``ddpkit run`` on N pods."""
from __future__ import annotations

import argparse

from ..launchers.k8s import DEFAULT_GRACE, KINDS, K8sJob, render_k8s

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ddpkit k8s``.

    Example::

        add_parser(argparse.ArgumentParser().add_subparsers())
    """
    p = sub.add_parser("k8s", help="print Kubernetes YAML for N pods x G GPUs",
                       description="Render the Kubernetes objects (a Kubeflow Trainer TrainJob, "
                                   "or an Indexed Job with a headless Service) that run SCRIPT "
                                   "with ddpkit run on every pod; kubectl apply -f the output.")
    p.add_argument("--nodes", type=int, default=1, help="pods (one per machine; default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1,
                   help="nvidia.com/gpu per pod, one process each (0: one CPU process)")
    p.add_argument("--image", help="container image with torch and ddpkit (required)")
    p.add_argument("--kind", choices=KINDS, default="indexed-job",
                   help="indexed-job: any cluster (a Job + headless Service); trainjob: "
                        "Kubeflow Trainer v2 (default indexed-job)")
    p.add_argument("--name", default="ddpkit", help="the job's name (RFC 1123; default ddpkit)")
    p.add_argument("--namespace")
    p.add_argument("--cpu", help="CPU per pod (a quantity: 16, 500m)")
    p.add_argument("--memory", help="memory per pod (a quantity: 64Gi)")
    p.add_argument("--shm-size", default="8Gi",
                   help="/dev/shm per pod for DataLoader workers (default 8Gi)")
    p.add_argument("--pvc", metavar="CLAIM:MOUNT",
                   help="a PersistentVolumeClaim every pod mounts (checkpoints: resume from it)")
    p.add_argument("--grace-period", type=int, default=DEFAULT_GRACE, metavar="SECONDS",
                   help="SIGTERM to SIGKILL on eviction: a step and a checkpoint save must fit "
                        f"(default {DEFAULT_GRACE})")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="ddpkit run's restarts when a pod is lost (default 3)")
    p.add_argument("--runtime", default="torch-distributed",
                   help="trainjob: the ClusterTrainingRuntime (default torch-distributed)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_k8s)


def _cmd_k8s(ns: argparse.Namespace) -> int:
    job = K8sJob(nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, image=ns.image,
                 script=ns.script, script_args=list(ns.script_args), kind=ns.kind, name=ns.name,
                 namespace=ns.namespace, cpu=ns.cpu, memory=ns.memory, shm_size=ns.shm_size,
                 pvc=ns.pvc, grace_period=ns.grace_period, max_restarts=ns.max_restarts,
                 runtime=ns.runtime)
    print(render_k8s(job), end="")
    return 0
