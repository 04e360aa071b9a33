"""Bad input, third round, row 6: --nproc against this node's cores and memory, before any worker
starts (`ddpkit run`, `ddpkit train`): a refusal with the numbers when the workers cannot fit in
memory even at what each holds once torch is imported, a warning with the numbers when a CPU-only
run asks for more processes than cores."""
import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.launchers import torchrun
from ddpkit.launchers.torchrun import RunConfig

GB = 10 ** 9
MB = 10 ** 6


def _capacity():
    from ddpkit.launchers import capacity

    return capacity


def _machine(monkeypatch, cores=2, available=24 * GB, floor=150 * MB, gpus=0):
    capacity = _capacity()
    monkeypatch.setattr(capacity, "usable_cores", lambda: cores)
    monkeypatch.setattr(capacity, "available_memory", lambda: available)
    monkeypatch.setattr(capacity, "worker_floor", lambda: floor)
    monkeypatch.setattr(torchrun.torch.cuda, "device_count", lambda: gpus)


def test_more_workers_than_memory_holds_is_refused_with_the_numbers(tmp_path, monkeypatch,
                                                                    capsys):
    _machine(monkeypatch, available=int(7.5 * GB))
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    with pytest.raises(ConfigError) as info:
        torchrun._validate(RunConfig(str(script), nproc=64))   # nothing started
    assert str(info.value) == (
        "--nproc 64 cannot fit in this node's memory: 64 workers need at least 9.6 GB (150 MB "
        "each, what a process holds once torch is imported, before any model or data) and 7.5 "
        "GB is available; use --nproc 50 or fewer (2 CPU cores here)")


def test_more_workers_than_cores_on_cpu_is_one_warning_with_the_numbers(tmp_path, monkeypatch,
                                                                        capsys):
    _machine(monkeypatch)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert torchrun._validate(RunConfig(str(script), nproc=64)) == 64
    assert capsys.readouterr().err.splitlines() == [
        "warning: --nproc 64 on 2 CPU cores and no GPU: each worker gets 1/32 of a core and "
        "every step waits for the slowest; they need at least 9.6 GB of the 24.0 GB available "
        "(150 MB each before any model or data); on CPU --nproc 2 (one per core) is usually "
        "fastest"]
    assert torchrun._validate(RunConfig(str(script), nproc=2)) == 2   # one per core: quiet
    _machine(monkeypatch, gpus=8)
    assert torchrun._validate(RunConfig(str(script), nproc=8)) == 8   # the GPUs' processes
    assert capsys.readouterr().err == ""


def test_what_cannot_be_read_checks_nothing(monkeypatch, capsys):
    capacity = _capacity()
    monkeypatch.setattr(capacity, "available_memory", lambda: None)
    monkeypatch.setattr(capacity, "usable_cores", lambda: 2)
    monkeypatch.setattr(capacity, "worker_floor", lambda: 150 * MB)
    capacity.check_memory(10 ** 6)   # no figure (not Linux): no refusal
    assert capsys.readouterr().err == ""


def test_the_machines_figures_are_read(monkeypatch):
    capacity = _capacity()
    assert capacity.usable_cores() >= 1
    available = capacity.available_memory()
    assert available is None or available > 0
    assert capacity.worker_floor() > 10 * MB   # this process, torch imported


def test_ddpkit_train_refuses_before_its_run_directory_is_written(tmp_path, monkeypatch):
    from ddpkit.job import start as start_module
    from ddpkit.job.config import TrainConfig

    _machine(monkeypatch, available=2 * GB)
    monkeypatch.setattr(start_module, "run", lambda *a, **k: pytest.fail("workers started"))
    with pytest.raises(ConfigError, match="--nproc 64 cannot fit in this node's memory"):
        start_module.start(TrainConfig(nproc=64, output=str(tmp_path / "run")))
    assert not (tmp_path / "run" / "config.json").exists()
