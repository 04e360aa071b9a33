"""ddpkit/env/k8s.py and its users: what a Kubernetes pod says (Kubeflow Trainer's PET_*, an
Indexed Job's JOB_COMPLETION_INDEX) becomes `ddpkit run`'s flags and a bare setup()'s place."""
import pytest

from ddpkit.cli import build_parser
from ddpkit.cli.flags import from_pod, run_config
from ddpkit.env.detect import detect
from ddpkit.base.errors import ConfigError, JobSetupError
from ddpkit.env.k8s import pod_launch
from ddpkit.launchers.network import wait_resolvable
from ddpkit.launchers.torchrun import resolve_nproc

# What Kubeflow Trainer's torch plugin sets on node 1 of TrainJob "mnist" (torch.go)
TRAINER = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "mnist-node-0-0.mnist", "PET_MASTER_PORT": "29500"}


def test_a_trainjob_pod_says_everything_and_an_indexed_job_its_index():
    pod = pod_launch(TRAINER)
    assert (pod.nnodes, pod.nproc, pod.node_rank, pod.endpoint, pod.source) == (
        "2", "4", 1, "mnist-node-0-0.mnist:29500", "PET_*")
    assert pod_launch({"JOB_COMPLETION_INDEX": "3"}).node_rank == 3
    assert pod_launch({"HOME": "/root"}) is None
    with pytest.raises(ConfigError, match="PET_NODE_RANK='x' is not an integer"):
        pod_launch({**TRAINER, "PET_NODE_RANK": "x"})


def test_ddpkit_run_takes_the_pods_values_where_no_flag_was_given(monkeypatch):
    monkeypatch.setattr("os.environ", {**TRAINER})
    ns = build_parser().parse_args(["run", "train.py"])
    cfg = run_config(ns, "train.py", nproc=ns.nproc)
    assert (cfg.nnodes, cfg.nproc, cfg.node_rank, cfg.rdzv_endpoint) == (
        2, "4", 1, "mnist-node-0-0.mnist:29500")
    # flags win, and a meeting point given on the command line wins whole
    ns = build_parser().parse_args(["run", "--nproc", "2", "--master-addr", "10.0.0.1",
                                    "train.py"])
    cfg = run_config(ns, "train.py", nproc=ns.nproc)
    assert (cfg.nproc, cfg.master_addr, cfg.rdzv_endpoint) == ("2", "10.0.0.1", None)
    monkeypatch.setattr("os.environ", {"JOB_COMPLETION_INDEX": "1"})
    ns = build_parser().parse_args(["run", "--nnodes", "2", "--rdzv-endpoint", "j-0.j:29500",
                                    "train.py"])
    assert run_config(ns, "train.py", nproc=ns.nproc).node_rank == 1
    assert from_pod({"nnodes": "3"}, {}) == {"nnodes": "3"}


def test_a_bare_process_in_a_pod_is_its_node():
    env = detect({**TRAINER, "PET_NPROC_PER_NODE": "1"})
    assert (env.rank, env.world_size, env.master_addr, env.master_port, env.launcher) == (
        1, 2, "mnist-node-0-0.mnist", 29500, "kubernetes")
    # torchrun's (or ddpkit run's) variables describe the real workers and win
    inner = detect({**TRAINER, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                    "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (inner.rank, inner.world_size, inner.launcher) == (5, 8, "torchrun")
    with pytest.raises(JobSetupError, match="PET_NPROC_PER_NODE=4 asks for that many on every "
                                            "node: start the script with `ddpkit run"):
        detect(TRAINER)
    with pytest.raises(ConfigError, match="rank 2 is impossible with world size 2"):
        detect({**TRAINER, "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "2"})
    assert detect({"JOB_COMPLETION_INDEX": "1"}).world_size == 1  # says nothing of the others


def test_torchruns_gpu_and_cpu_process_counts():
    assert resolve_nproc("gpu", cuda_count=4) == 4 and resolve_nproc("auto", cuda_count=0) >= 1
    assert resolve_nproc("cpu") >= 1
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        resolve_nproc("gpu", cuda_count=0)


@pytest.mark.slow
def test_waiting_for_a_pods_dns_name_says_so_once_then_resolves_or_gives_up():
    answers, said = iter([None, None, "10.4.0.7"]), []

    def lookup(host):
        ip = next(answers)
        if ip is None:
            raise ConfigError("does not resolve")
        return ip

    assert wait_resolvable("j-0.j", 10, said.append, lookup) == "10.4.0.7"
    assert len(said) == 1 and "waiting up to 10 s for the rendezvous host j-0.j" in said[0]

    def never(host):
        raise ConfigError("does not resolve")

    with pytest.raises(ConfigError, match="'j-0.j' did not resolve within 0 s: its pod never"):
        wait_resolvable("j-0.j", 0.2, said.append, never)
