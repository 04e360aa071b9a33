"""ddpkit.job.start: where `ddpkit train` runs a job, from Python as from the command line; the
worker entry; and the main job after a bare `pip install ddpkit` (no optional package)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ddpkit.checkpoint.files import find_latest
from ddpkit.errors import ConfigError
from ddpkit.job.config import TrainConfig
from ddpkit.job.start import WORKER, job_nproc, plan, start
from ddpkit.launch.torchrun import RunConfig

from test_cli import ddpkit


@pytest.mark.parametrize("nproc,launch,inside,strategy,where", [
    (1, {}, False, "ddp", "here"),
    (2, {}, False, "ddp", "torchrun"),
    (1, {"nnodes": 2}, False, "ddp", "torchrun"),
    (1, {"max_restarts": 1}, False, "ddp", "torchrun"),   # restarts need torchrun's agent
    (2, {}, True, "ddp", "here"),                          # already a worker of torchrun
    (2, {}, False, "horovod", "horovodrun"),
    (1, {}, False, "horovod", "here"),
])
def test_plan_picks_where_the_job_runs(nproc, launch, inside, strategy, where):
    cfg = TrainConfig(nproc=nproc, strategy=strategy)
    assert plan(cfg, RunConfig(WORKER, **launch), inside) == where


def test_start_from_python_trains_in_this_process(tmp_path, capsys):
    out = tmp_path / "run"
    assert start(TrainConfig(nproc=1, epochs=1, max_steps=3, output=str(out),
                             progress=False)) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["max_steps"] == 3 and saved["nproc"] == 1
    assert "resolved config (saved to" in capsys.readouterr().out
    assert list((out / "checkpoints").glob("ckpt-*.pt"))  # stopped by max_steps: work kept


@pytest.mark.slow
def test_the_worker_entry_has_help_and_one_line_errors(tmp_path):
    def worker(*args):
        return subprocess.run([sys.executable, "-m", WORKER, *args], capture_output=True,
                              text=True, timeout=60)

    ok = worker("--help")
    assert ok.returncode == 0 and ok.stdout.startswith("usage: python -m ddpkit.job.train")
    none = worker()
    assert none.returncode == 2 and none.stderr.count("\n") == 1
    missing = worker(str(tmp_path / "nope.json"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: cannot read the job config") and \
        "Traceback" not in missing.stderr


@pytest.mark.slow
def test_the_main_job_runs_without_any_optional_package(tmp_path):
    # What `pip install ddpkit` alone gives: torch, tqdm, numpy. The optional packages are made
    # unimportable for the launcher and every worker (they inherit PYTHONPATH).
    blocked = tmp_path / "blocked"
    for name in ("sklearn", "yaml", "tensorboard", "torchmetrics", "matplotlib", "horovod"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked')\n")
    out = tmp_path / "run"
    res = ddpkit("train", "--epochs", "1", "--output", str(out), env={"PYTHONPATH": str(blocked)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "final: top-1" in res.stdout and "359 test samples" in res.stdout


# ----------------------------------------------------------------------------- --nproc auto

def test_job_nproc_auto_is_one_per_gpu_and_two_on_cpu(monkeypatch):
    assert job_nproc("auto", gpus=8) == 8 and job_nproc("auto", gpus=1) == 1
    assert job_nproc(3, gpus=8) == 3 and job_nproc("5", gpus=0) == 5
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert job_nproc("auto", gpus=0) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert job_nproc("auto", gpus=0) == 1
    with pytest.raises(ConfigError, match="positive integer or 'auto'"):
        job_nproc("two", gpus=0)


@pytest.mark.slow
def test_default_job_saves_the_resolved_process_count(tmp_path):
    # auto on this CPU machine: 2 processes; the run directory records the number, not 'auto'
    assert start(TrainConfig(nproc="auto", epochs=1, max_steps=2, output=str(tmp_path),
                             progress=False)) == 0
    assert json.loads((tmp_path / "config.json").read_text())["nproc"] == min(2, os.cpu_count())


def test_more_processes_than_gpus_under_nccl_is_refused_before_launch(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as exc:
        start(TrainConfig(nproc=2, output=str(tmp_path)))
    assert str(exc.value).startswith("2 processes on this node but only 1 CUDA device(s): NCCL "
                                     "needs one GPU per process; use --nproc 1 (or auto)")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.slow
def test_cuda_requested_on_a_machine_without_it_is_one_line(tmp_path):
    res = ddpkit("train", "--accelerator", "cuda", "--output", str(tmp_path))
    assert res.returncode != 0
    assert res.stderr.strip() == ("error: --accelerator cuda: no CUDA device is visible here; use "
                                  "--accelerator cpu (or auto), or check CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_compile_trains_on_cpu_and_checkpoints_clean_names(tmp_path):
    res = ddpkit("train", "--nproc", "1", "--compile", "--epochs", "1", "--max-steps", "3",
                 "--output", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    _path, ckpt = find_latest(tmp_path / "checkpoints")
    assert ckpt["progress"]["step"] == 3
    assert list(ckpt["model"])[:2] == ["conv1.weight", "bn1.weight"]


@pytest.mark.slow
def test_compile_without_a_compiler_is_one_line(tmp_path):
    res = ddpkit("train", "--nproc", "1", "--compile", "--output", str(tmp_path),
                 env={"PATH": str(tmp_path)})  # no g++ / clang++ on PATH
    assert res.returncode != 0
    assert res.stderr.strip() == ("error: --compile: torch.compile on CPU needs a C++ compiler "
                                  "(g++ or clang++) on PATH; drop --compile to train without it")
