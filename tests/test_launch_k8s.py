"""`ddpkit k8s` (launch/k8s.py): both kinds render, validate against the schemas of their API
versions (Kubernetes v1.37's OpenAPI through kubernetes-validate, strict: no unknown field; the
TrainJob through Kubeflow Trainer v2.3.0's models, generated from its OpenAPI spec, with every
field kept on the round trip), carry what the pods need, and bad input is one line."""
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

from ddpkit.base.errors import ConfigError
from ddpkit.launchers.k8s import AGENT_MARGIN, PORT, K8sJob, render_k8s, to_yaml

K8S_VERSION = "1.37.0"   # the schemas kubernetes-validate 1.37.0 carries


def docs(job):
    return list(yaml.safe_load_all(render_k8s(job)))


def job(**kw):
    base = dict(nodes=2, gpus_per_node=8, image="ghcr.io/me/train:1", script="train.py",
                script_args=["--epochs", "10", "--out", "/ckpt/run"], pvc="ckpt:/ckpt",
                cpu="32", memory="256Gi")
    return K8sJob(**{**base, **kw})


@pytest.mark.parametrize("gpus", [8, 0])
def test_the_indexed_job_and_its_service_validate_against_kubernetes_schema(gpus):
    service, batch = docs(job(gpus_per_node=gpus))
    for doc in (service, batch):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert (service["kind"], batch["kind"]) == ("Service", "Job")
    # a headless Service over the Job's pods, and the pods are its subdomain: pod i is NAME-i.NAME
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": "ddpkit"}
    spec = batch["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["command"][:2] == ["ddpkit", "run"]
    cmd = container["command"]
    flag = {cmd[i]: cmd[i + 1] for i in range(2, cmd.index("train.py"), 2)}
    assert flag == {"--nnodes": "2", "--nproc": str(gpus or 1),
                    "--node-rank": "$(JOB_COMPLETION_INDEX)",
                    "--rdzv-endpoint": f"ddpkit-0.ddpkit:{PORT}", "--rdzv-id": "ddpkit",
                    "--max-restarts": "3"}
    assert cmd[cmd.index("train.py"):] == ["train.py", "--epochs", "10", "--out", "/ckpt/run"]
    limits = container.get("resources", {}).get("limits", {})
    assert limits.get("nvidia.com/gpu") == ("8" if gpus else None)
    # an eviction does not count as a failure; the checkpoint volume and /dev/shm are mounted
    rule = spec["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "Ignore" and rule["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/dev/shm", "/ckpt"}
    assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            "value": str(pod["terminationGracePeriodSeconds"] - AGENT_MARGIN)} in container["env"]


def test_the_trainjob_validates_against_kubeflow_trainers_schema():
    (train,) = docs(job(kind="trainjob", namespace="team-a", grace_period=300))
    model = TrainerV1alpha1TrainJob.from_dict(train)
    # every field the manifest sets is one the schema knows (an unknown one would be dropped)
    assert model.to_dict() == train
    assert (train["apiVersion"], train["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    trainer = train["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 8
    # the operator sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT: ddpkit run reads them
    assert trainer["command"] == ["ddpkit", "run", "--max-restarts", "3", "train.py"]
    assert trainer["args"] == ["--epochs", "10", "--out", "/ckpt/run"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    pod = train["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 300
    assert [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]] == ["/dev/shm", "/ckpt"]
    # the pod-level parts are real Kubernetes objects too
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                                  "spec": {**pod, "containers": [{**pod["containers"][0],
                                                                  "image": "x"}]}},
                                 K8S_VERSION, strict=True)


def test_a_broken_manifest_fails_both_validators():
    # the validators do reject: a typo and a wrong type
    service, batch = docs(job())
    batch["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(batch, K8S_VERSION, strict=True)
    (train,) = docs(job(kind="trainjob"))
    train["spec"]["trainer"]["numNodes"] = "two"
    with pytest.raises(Exception, match="numNodes|num_nodes"):
        TrainerV1alpha1TrainJob.from_dict(train)
    (train,) = docs(job(kind="trainjob"))
    train["spec"]["trainer"]["numNode"] = 2
    assert TrainerV1alpha1TrainJob.from_dict(train).to_dict() != train


@pytest.mark.parametrize("text", ["on", "yes", "No", "null", "~", "1e3", "0x1F", "a: b", "#x",
                                  "-", "- x", "", " lead", "trail ", "12", "3.5", "$(X) y",
                                  "multi\nline", "quote\"s", "--flag", "-1", "*ref", "!tag"])
def test_yaml_strings_read_back_as_the_same_strings(text):
    doc = {"command": ["ddpkit", text], "value": text, "n": 3, "b": True}
    assert yaml.safe_load(to_yaml(doc)) == doc


@pytest.mark.parametrize("kw,words", [
    (dict(nodes=0), "--nodes must be an integer >= 1"),
    (dict(image=None), "--image is required"),
    (dict(image=""), "--gpus-per-node 8 needs one with CUDA"),
    (dict(image="BAD!!img::"), "--image 'BAD!!img::' is not a container image reference"),
    (dict(image="my image"), "--image 'my image' is not a container image reference"),
    (dict(image="Me/Train:1"), "the name in lower case"),
    (dict(name="My_Job"), "--name 'My_Job' is not a valid Kubernetes name"),
    (dict(name="x" * 60), "at most 52 characters"),
    (dict(namespace="Team A"), "--namespace 'Team A' is not a valid Kubernetes name"),
    (dict(grace_period=5), "--grace-period must be at least 15 s"),
    (dict(memory="eight"), "--memory 'eight' is not a Kubernetes quantity"),
    (dict(memory="4Gi"), "--shm-size 8Gi is larger than --memory 4Gi"),
    (dict(pvc="ckpt"), "give CLAIM:MOUNT"),
    (dict(kind="pytorchjob"), "--kind must be one of"),
])
def test_bad_input_is_one_line(kw, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as err:
        render_k8s(job(**kw))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_the_cli_prints_the_yaml_and_bad_input_is_one_error_line(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "ddpkit", "k8s", "--nodes", "2", "--image",
                         "img:1", "--kind", "trainjob", "train.py", "--lr", "0.1"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert list(yaml.safe_load_all(ok.stdout))[0]["spec"]["trainer"]["args"] == ["--lr", "0.1"]
    for args, words in ((["--nodes", "0", "--image", "i"], "--nodes must be an integer >= 1"),
                        (["--gpus-per-node", "4"], "--image is required"),
                        (["--image", "i", "--name", "Bad.Name"], "not a valid Kubernetes name"),
                        (["--image", "i", "--grace-period", "3"], "--grace-period must be"),
                        (["--image", "BAD!!img::"], "is not a container image reference")):
        bad = subprocess.run([sys.executable, "-m", "ddpkit", "k8s", *args, "train.py"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stdout == ""
        assert bad.stderr.count("\n") == 1 and words in bad.stderr, bad.stderr
