"""Shared fixtures: fail a test that leaks launcher variables or a process group; put back the
signal handlers a test changed; keep the suite hermetic on GPU machines (every test runs on CPU +
gloo unless it is marked ``gpu``)."""
import os
import signal

import pytest
import torch
import torch.distributed as tdist

# Asked once, before any test hides the GPUs: does this machine have CUDA at all?
CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_CUDA_REASON = "needs a CUDA GPU (none visible here); `make test-gpu` runs these on a GPU machine"

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaks launcher variables or a process group; put back any other
    variable a test changed. The launcher run in-process (``ddpkit.job.start.start``) sets its
    children's OMP_NUM_THREADS, GLOO_SOCKET_IFNAME, ... in ``os.environ``: the ``ddpkit run``
    of every later test in that pytest process inherited them (with 2 pytest workers a language
    model test compared its 1- and 2-process runs at 1 thread where it expected 2, and missed
    its tolerance)."""
    environ = dict(os.environ)
    yield
    before = {k: environ.get(k) for k in LAUNCH_VARS}
    after = {k: os.environ.get(k) for k in LAUNCH_VARS}
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    assert before == after, f"test leaked launcher variables: {before} -> {after}"
    assert not tdist.is_initialized(), "test left a process group behind"


HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT",
                                                  "SIGUSR1") if hasattr(signal, name))

# A suite started as a background job of a script (`make test &`, nohup) inherits SIGINT
# ignored, and every process a test starts would too: the Ctrl-C tests would test nothing
# (5 failed so). They test ddpkit's handling of a Ctrl-C, so the suite takes SIGINT back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """torchrun's agent run in-process (``ddpkit.job.start.start``) installs its own handlers
    (SIGINT raises its SignalException, not KeyboardInterrupt) and leaves them: the tests after
    it get Python's own again."""
    before = {s: signal.getsignal(s) for s in HANDLED}
    yield
    for s, handler in before.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


@pytest.fixture(autouse=True)
def cpu_unless_gpu_test(request, monkeypatch):
    """Tests not marked ``gpu`` see no GPU, in this process and in every process they start
    (ranks, CLI runs), so the suite means the same on a CPU laptop and on a GPU node. Tests
    marked ``gpu`` see the real devices, or skip with the reason where there are none."""
    if request.node.get_closest_marker("gpu") is not None:
        if not CUDA_COUNT:
            pytest.skip(NO_CUDA_REASON)
        return
    if CUDA_COUNT:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def env_without_launcher(monkeypatch):
    """os.environ without any launcher or Slurm variables."""
    for key in list(os.environ):
        if key in LAUNCH_VARS or key.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    return os.environ


MULTINODE_FILES = ("test_multinode.py", "test_launch_network.py", "test_crash.py",
                   "test_doctor_multinode.py")


@pytest.fixture
def small_disk(tmp_path, request):
    """A small tmpfs (root only): 1 MB, or the size a test's ``disk_size`` marker gives."""
    import subprocess
    marker = request.node.get_closest_marker("disk_size")
    size = marker.args[0] if marker else "1m"
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the 'fsize' own-loop tests cover the "
                    "same path with a file-size limit)")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


#: Files whose tests bring up a cluster of their own (nodes, Slurm's daemons on fixed ports, pods)
#: and load both cores: `make test` runs them by themselves, the rest on 2 workers at once.
ALONE_FILES = MULTINODE_FILES + ("test_slurm.py", "test_k8s_pods.py")


def pytest_collection_modifyitems(config, items):
    """Multi-node tests (network namespaces; they skip with the reason when not root or without
    `ip netns`) carry the `multinode` marker: part of `make test`; `make test-multinode` runs
    only them. Those and the other tests of :data:`ALONE_FILES` carry `alone`."""
    for item in items:
        if item.path.name in MULTINODE_FILES:
            item.add_marker(pytest.mark.multinode)
        if item.path.name in ALONE_FILES:
            item.add_marker(pytest.mark.alone)
