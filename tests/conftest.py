"""Shared fixtures: fail a test that leaks launcher variables or a process group."""
import os

import pytest
import torch.distributed as tdist

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_leaks():
    before = {k: os.environ.get(k) for k in LAUNCH_VARS}
    yield
    after = {k: os.environ.get(k) for k in LAUNCH_VARS}
    assert before == after, f"test leaked launcher variables: {before} -> {after}"
    assert not tdist.is_initialized(), "test left a process group behind"


@pytest.fixture
def env_without_launcher(monkeypatch):
    """os.environ without any launcher or Slurm variables."""
    for key in list(os.environ):
        if key in LAUNCH_VARS or key.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    return os.environ


MULTINODE_FILES = ("test_multinode.py", "test_launch_network.py", "test_crash.py")


def pytest_collection_modifyitems(config, items):
    """Multi-node tests (network namespaces; they skip with the reason when not root or without
    `ip netns`) carry the `multinode` marker: part of `make test`; `make test-multinode` runs
    only them."""
    for item in items:
        if item.path.name in MULTINODE_FILES:
            item.add_marker(pytest.mark.multinode)
