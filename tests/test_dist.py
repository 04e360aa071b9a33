"""Device, backend and init-method resolution, thread split, single-process group set-up.

Everything here is pure logic over a ClusterEnv: no process group is ever created.
"""
import os

import pytest
import torch
import torch.distributed as tdist

from ddpkit.env.dist import (DEFAULT_TIMEOUT, cpu_threads_per_process, init_process_group,
                         resolve_backend, resolve_init_method, select_device, shutdown)
from ddpkit.env.detect import ClusterEnv, spawn_env
from ddpkit.base.errors import ConfigError

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)


def _node(local_rank, local_world_size):
    return ClusterEnv(rank=local_rank, world_size=local_world_size, local_rank=local_rank,
                      local_world_size=local_world_size)


def test_default_timeout_is_ten_minutes():
    assert DEFAULT_TIMEOUT.total_seconds() == 600


# --------------------------------------------------------------------------- select_device


@pytest.mark.parametrize("accelerator", ["auto", "cpu"])
def test_no_gpu_gives_cpu(accelerator):
    assert select_device(_node(1, 2), accelerator, cuda_count=0) == CPU


def test_cpu_forced_even_with_gpus():
    assert select_device(_node(1, 2), "cpu", cuda_count=4) == CPU


@pytest.mark.parametrize("count,local_rank,local_world,expected", [
    (2, 0, 2, 0), (2, 1, 2, 1), (4, 3, 4, 3), (4, 1, 2, 1), (4, 0, 1, 0), (2, 1, 1, 1),
])
@pytest.mark.parametrize("accelerator", ["auto", "cuda"])
def test_gpu_per_local_rank(count, local_rank, local_world, expected, accelerator):
    env = ClusterEnv(rank=local_rank, world_size=max(local_world, local_rank + 1),
                     local_rank=local_rank, local_world_size=local_world)
    assert select_device(env, accelerator, cuda_count=count) == torch.device("cuda", expected)


def test_local_rank_wraps_modulo_gpu_count():
    # local_rank % count (only reachable with an env that was not validated)
    env = ClusterEnv(rank=5, world_size=8, local_rank=5, local_world_size=2)
    assert select_device(env, "cuda", cuda_count=4) == torch.device("cuda", 1)


@pytest.mark.parametrize("accelerator", ["auto", "cuda"])
@pytest.mark.parametrize("backend", [None, "nccl"])
def test_more_local_processes_than_gpus_under_nccl(accelerator, backend):
    with pytest.raises(ConfigError) as exc:
        select_device(_node(0, 4), accelerator, cuda_count=2, backend=backend)
    assert str(exc.value) == (
        "4 processes on this node but only 2 CUDA device(s): NCCL needs one GPU per process; use "
        "--nproc 2 (or auto), or --backend gloo to let processes share a GPU (for testing, not "
        "speed)")


def test_processes_share_gpus_over_gloo_with_one_note(capsys):
    devices = [select_device(_node(r, 4), "auto", cuda_count=2, backend="gloo") for r in range(4)]
    assert devices == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # local rank 0 only
    assert err == ("note: 4 processes share 2 GPU(s) over gloo: right for testing DDP on one "
                   "machine, not for speed\n")


def test_cuda_requested_without_devices():
    with pytest.raises(ConfigError) as exc:
        select_device(ClusterEnv(), "cuda", cuda_count=0)
    assert str(exc.value) == ("accelerator 'cuda' was requested but no CUDA device is visible; use "
                              "--accelerator cpu or check CUDA_VISIBLE_DEVICES")


@pytest.mark.parametrize("accelerator", ["tpu", "gpu", "CUDA", ""])
def test_unknown_accelerator(accelerator):
    with pytest.raises(ConfigError) as exc:
        select_device(ClusterEnv(), accelerator, cuda_count=0)
    assert str(exc.value) == f"unknown accelerator {accelerator!r}; use auto, cpu or cuda"


def test_device_count_taken_from_torch_when_not_given(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device(_node(1, 2)) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert select_device(_node(1, 2)) == CPU


# --------------------------------------------------------------------------- resolve_backend


@pytest.mark.parametrize("backend", [None, "", "auto"])
def test_auto_backend(backend):
    assert resolve_backend(backend, CPU) == "gloo"
    assert resolve_backend(backend, CUDA0) == "nccl"


def test_explicit_backends_accepted():
    assert resolve_backend("gloo", CPU) == "gloo"
    assert resolve_backend("gloo", CUDA0) == "gloo"
    assert resolve_backend("nccl", CUDA0) == "nccl"
    assert resolve_backend("mpi", CPU) == "mpi"


def test_nccl_on_cpu_suggests_gloo():
    with pytest.raises(ConfigError) as exc:
        resolve_backend("nccl", CPU)
    assert str(exc.value) == ("backend 'nccl' needs CUDA devices but this process runs on CPU; "
                              "use --backend gloo (or leave it unset)")


@pytest.mark.parametrize("backend", ["NCCL", "tcp", "glo"])
def test_unknown_backend_lists_choices(backend):
    with pytest.raises(ConfigError) as exc:
        resolve_backend(backend, CPU)
    assert str(exc.value) == (f"unknown backend {backend!r}; choose one of gloo, nccl, mpi, ucc, "
                              "xccl or leave it unset for automatic choice")


# --------------------------------------------------------------------------- resolve_init_method


def _env(launcher, addr="10.0.0.1", port=29500, world=4, rank=1):
    return ClusterEnv(rank=rank, world_size=world, local_rank=rank % 2, local_world_size=2,
                      master_addr=addr, master_port=port, launcher=launcher)


def test_torchrun_uses_env():
    assert resolve_init_method(_env("torchrun")) == "env://"


@pytest.mark.parametrize("launcher", ["slurm", "spawn"])
def test_slurm_and_spawn_use_tcp(launcher):
    assert resolve_init_method(_env(launcher, "gpu07", 12345)) == "tcp://gpu07:12345"


def test_spawn_env_helper():
    assert resolve_init_method(spawn_env(1, 2, master_port=29511)) == "tcp://127.0.0.1:29511"


@pytest.mark.parametrize("addr,expected", [("::1", "tcp://[::1]:29500"),
                                           ("fe80::1%eth0", "tcp://[fe80::1%eth0]:29500"),
                                           ("2001:db8::7", "tcp://[2001:db8::7]:29500")])
def test_ipv6_address_bracketed(addr, expected):
    assert resolve_init_method(_env("slurm", addr)) == expected


@pytest.mark.parametrize("url", ["file:///shared/job42.init", "tcp://10.1.1.1:23456",
                                 "tcp://[::1]:23456"])
def test_explicit_file_and_tcp_accepted_without_master(url):
    assert resolve_init_method(_env("slurm", None, None), url) == url
    assert resolve_init_method(_env("torchrun"), url) == url


def test_explicit_env_accepted_with_master():
    assert resolve_init_method(_env("slurm"), "env://") == "env://"


def test_explicit_env_without_master_rejected():
    with pytest.raises(ConfigError) as exc:
        resolve_init_method(_env("torchrun", None, None), "env://")
    assert str(exc.value) == "init method env:// needs MASTER_ADDR and MASTER_PORT"


@pytest.mark.parametrize("url", ["http://host:1", "udp://h:1", "/shared/file", "ENV://"])
def test_bad_scheme_rejected(url):
    with pytest.raises(ConfigError) as exc:
        resolve_init_method(_env("slurm"), url)
    assert str(exc.value) == f"init method {url!r} must start with env://, tcp:// or file://"


@pytest.mark.parametrize("addr,port", [(None, None), (None, 29500), ("10.0.0.1", None), ("", 1)])
@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "spawn"])
def test_world_without_master_rejected(addr, port, launcher):
    with pytest.raises(ConfigError) as exc:
        resolve_init_method(_env(launcher, addr, port, world=4))
    assert str(exc.value) == ("world size 4 needs a master address and port (MASTER_ADDR/MASTER_PORT, "
                              "or an init method such as file:///shared/f)")


# --------------------------------------------------------------------------- cpu threads


def test_threads_split_between_local_processes(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_threads_per_process(_node(0, 2), {}) == 4
    assert cpu_threads_per_process(_node(0, 3), {}) == 2
    assert cpu_threads_per_process(_node(0, 16), {}) == 1  # never 0


def test_threads_unknown_cpu_count(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cpu_threads_per_process(_node(0, 2), {}) == 1


def test_threads_left_alone_with_omp_num_threads(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_threads_per_process(_node(0, 2), {"OMP_NUM_THREADS": "3"}) is None
    assert cpu_threads_per_process(_node(0, 2), {"OMP_NUM_THREADS": ""}) is None


def test_threads_left_alone_for_one_local_process(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_threads_per_process(ClusterEnv(), {}) is None
    # one process on each of 4 nodes: the node's cores are all its own
    env = ClusterEnv(rank=2, world_size=4, local_rank=0, local_world_size=1)
    assert cpu_threads_per_process(env, {}) is None


def test_threads_default_environ_is_os_environ(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads_per_process(_node(0, 2)) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads_per_process(_node(0, 2)) == 4


# --------------------------------------------------------------------------- init / shutdown


def test_single_process_init_creates_no_group():
    assert not tdist.is_initialized()
    assert init_process_group(ClusterEnv(), CPU) is None
    assert not tdist.is_initialized()


def test_single_process_ignores_backend_and_init_method():
    # With one process nothing is resolved: no master is needed.
    assert init_process_group(ClusterEnv(), CPU, backend="gloo", init_method="env://") is None
    assert not tdist.is_initialized()


def test_single_process_on_cuda_selects_the_device_first(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert init_process_group(ClusterEnv(), torch.device("cuda", 0)) is None
    assert calls == [torch.device("cuda", 0)]
    assert not tdist.is_initialized()


def test_distributed_env_with_bad_backend_fails_before_any_group():
    env = _env("spawn", world=2, rank=0)
    with pytest.raises(ConfigError, match="backend 'nccl' needs CUDA devices"):
        init_process_group(env, CPU, backend="nccl")
    with pytest.raises(ConfigError, match="must start with env://, tcp:// or file://"):
        init_process_group(env, CPU, init_method="http://x")
    with pytest.raises(ConfigError, match="world size 2 needs a master address and port"):
        init_process_group(_env("spawn", None, None, world=2, rank=0), CPU)
    assert not tdist.is_initialized()


def test_shutdown_without_group_is_safe_twice():
    shutdown()
    shutdown()
    assert not tdist.is_initialized()


@pytest.mark.parametrize("shared, restarts, prefixed", [(True, 1, True), (False, 1, False),
                                                       (True, 0, False)])
def test_attempt_prefix_only_when_the_agent_store_is_shared(monkeypatch, shared, restarts,
                                                           prefixed):
    """After a restart a shared agent store holds stale addresses: namespace it by attempt. A
    store per round (multi-node ``ddpkit run``) is fresh, and restart counts differ by node."""
    import ddpkit.env.dist as ddist

    calls = []
    monkeypatch.setattr(ddist, "rendezvous", lambda url, timeout: iter([(tdist.HashStore(), 0, 2)]))
    monkeypatch.setattr(ddist.tdist, "init_process_group", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(ddist.atexit, "register", lambda fn: None)
    env = ClusterEnv(rank=0, world_size=2, local_rank=0, local_world_size=1, launcher="torchrun",
                     master_addr="127.0.0.1", master_port=29500, restart_count=restarts,
                     shared_store=shared)
    assert init_process_group(env, CPU, backend="gloo") == "gloo"
    (kwargs,) = calls
    assert isinstance(kwargs.get("store"), tdist.PrefixStore) is prefixed
    assert ("init_method" in kwargs) is not prefixed
