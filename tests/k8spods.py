"""Kubernetes' side of `ddpkit k8s`, played on tests/netns.py: no control plane can run here, so
this starts, for each pod a rendered manifest describes, exactly the container's command and
environment (what the Job controller, the kubelet and Kubeflow Trainer's torch plugin give it:
JOB_COMPLETION_INDEX, $(VAR) expansion, PET_*) in a network namespace with the pod's hostname,
and DNS names (`NAME-0.NAME`) that resolve only once that pod has started, as cluster DNS does
for a headless Service. A failed pod is started again (restartPolicy Never: a new pod, same
index); an evicted one gets SIGTERM, then SIGKILL after its terminationGracePeriodSeconds.

What it does not do: scheduling, images, volumes (a shared directory stands for the PVC),
resource limits, the operator's JobSet, or kubelet's real /etc/hosts.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import yaml

from netns import NETNS_ETC, Cluster

PORT = 29500  # Kubeflow Trainer's ContainerTrainerPort


@dataclass
class PodSpec:
    hostname: str
    subdomain: str
    command: List[str]
    env: Dict[str, str]
    grace: int


@dataclass
class Job:
    pods: List[PodSpec]
    backoff_limit: int
    evictions_ignored: bool
    name: str = ""
    extra: Dict[str, object] = field(default_factory=dict)


def _expand(arg: str, env: Dict[str, str]) -> str:
    # The kubelet expands $(VAR) from the container's environment; $$ escapes.
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def _env_list(items) -> Dict[str, str]:
    return {e["name"]: e["value"] for e in items or []}


def from_manifest(text: str) -> Job:
    """The pods a `ddpkit k8s` manifest makes, as the cluster would start them."""
    docs = list(yaml.safe_load_all(text))
    kinds = {d["kind"]: d for d in docs}
    if "TrainJob" in kinds:
        return _trainjob(kinds["TrainJob"])
    return _indexed_job(kinds["Job"], kinds["Service"])


def _indexed_job(job: dict, service: dict) -> Job:
    name, spec = job["metadata"]["name"], job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    (container,) = pod["containers"]
    pods = []
    for i in range(spec["completions"]):
        env = {**_env_list(container.get("env")), "JOB_COMPLETION_INDEX": str(i)}
        pods.append(PodSpec(f"{name}-{i}", pod["subdomain"],
                            [_expand(a, env) for a in container["command"]], env,
                            pod["terminationGracePeriodSeconds"]))
    ignored = any(r["action"] == "Ignore" and any(c["type"] == "DisruptionTarget"
                                                  for c in r.get("onPodConditions", []))
                  for r in spec.get("podFailurePolicy", {}).get("rules", []))
    return Job(pods, spec["backoffLimit"], ignored, name)


def _trainjob(tj: dict) -> Job:
    # What Kubeflow Trainer makes of it: a JobSet whose ReplicatedJob "node" is an Indexed Job
    # (pods NAME-node-0-INDEX, subdomain NAME), with the torch plugin's PET_* (torch.go).
    name, trainer = tj["metadata"]["name"], tj["spec"]["trainer"]
    patch = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pods = []
    for i in range(trainer["numNodes"]):
        env = {**_env_list(trainer.get("env")), "JOB_COMPLETION_INDEX": str(i),
               "PET_NNODES": str(trainer["numNodes"]),
               "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
               "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
               "PET_MASTER_PORT": str(PORT)}
        command = [_expand(a, env) for a in trainer["command"] + trainer.get("args", [])]
        pods.append(PodSpec(f"{name}-node-0-{i}", name, command, env,
                            patch["terminationGracePeriodSeconds"]))
    # The torch-distributed runtime's Job sets neither backoffLimit nor podFailurePolicy:
    # Kubernetes' defaults, 6 failures, an eviction counted as one.
    return Job(pods, 6, False, name)


class PodCluster(Cluster):
    """netns nodes named as the job's pods; a pod's DNS names resolve once it has started."""

    def __init__(self, job: Job, workdir, path_dir: str) -> None:
        self.job, self.path_dir = job, path_dir
        self.published: set = set()
        self.lock = threading.Lock()
        super().__init__(len(job.pods), workdir=workdir, hostnames=True)
        self.failures, self.starts = 0, [0] * len(job.pods)
        self.codes: List[Optional[int]] = [None] * len(job.pods)
        self.evicted: Dict[int, float] = {}

    def hostname(self, node: int) -> str:
        return self.job.pods[node].hostname

    def _names(self, j: int) -> str:
        pod = self.job.pods[j]
        short = f"{pod.hostname}.{pod.subdomain}"
        return f"{self.ip(j)} {short}.default.svc.cluster.local {short} {pod.hostname}"

    def _write_hosts(self, ns: str) -> None:
        # kubelet's own entry, plus cluster DNS's answers for the pods that have started
        me = next(i for i in range(self.nodes) if self.ns(i) == ns)
        lines = ["127.0.0.1 localhost", self._names(me)]
        lines += [self._names(j) for j in sorted(self.published) if j != me]
        (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / ns / "hosts").write_text("\n".join(lines) + "\n")  # same inode: seen live
        (NETNS_ETC / ns / "resolv.conf").write_text("# k8s pod stand-in: /etc/hosts only\n")

    def start_pod(self, i: int, cwd: str) -> None:
        """Start pod ``i`` (again): its command and environment, and publish its DNS name."""
        with self.lock:
            self.published.add(i)
            for j in range(self.nodes):
                self._write_hosts(self.ns(j))
        pod = self.job.pods[i]
        env = {**pod.env, "PATH": self.path_dir + os.pathsep + os.environ.get("PATH", "")}
        self.starts[i] += 1
        self.start(i, pod.command, env=env, cwd=cwd)

    def evict(self, i: int) -> None:
        """What a drained node does to a pod: SIGTERM to its main process, SIGKILL after the
        grace period."""
        proc = self.procs[i]
        self.evicted[i] = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        grace = self.job.pods[i].grace

        def kill_late():
            try:
                proc.wait(timeout=grace)
            except Exception:  # noqa: BLE001 - past the grace period: what the kubelet does
                self.kill(i, signal.SIGKILL)
        threading.Thread(target=kill_late, daemon=True).start()

    def run_job(self, cwd: str, timeout: float, order=None, delay: float = 0.0,
                on_tick=None, start_when=None) -> bool:
        """The Job controller: start every pod (in ``order``, ``delay`` s apart, or each after
        the first once ``start_when(self)`` holds: an event, not a guess of how long a start
        takes on a loaded machine), start a failed one again (an eviction does not count against
        backoffLimit when the failure policy says so) until every index succeeded; False if the
        backoff limit was passed."""
        for k, i in enumerate(order or range(self.nodes)):
            if k:
                time.sleep(delay)
                gate = time.monotonic() + timeout
                while start_when is not None and not start_when(self):
                    if time.monotonic() > gate:
                        raise TimeoutError("the condition to start pod %d never held:\n%s"
                                           % (i, self.tails()))
                    time.sleep(0.1)
            self.start_pod(i, cwd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if on_tick:
                on_tick(self)
            for i, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None or self.codes[i] == 0:
                    continue
                self.codes[i] = code
                if code == 0:
                    continue
                evicted = self.evicted.pop(i, None) is not None
                if not (evicted and self.job.evictions_ignored):
                    self.failures += 1
                if self.failures > self.job.backoff_limit:
                    return False
                self.start_pod(i, cwd)
                self.codes[i] = None
            if all(c == 0 for c in self.codes):
                return True
            time.sleep(0.2)
        raise TimeoutError("the job did not finish:\n" + self.tails())


def ddpkit_bin() -> str:
    """Where the `ddpkit` command of this interpreter lives (the pods' image has it on PATH)."""
    return os.path.dirname(sys.executable)
