"""ddpkit.job.start: where `ddpkit train` runs a job, from Python as from the command line; the
worker entry; and the main job after a bare `pip install ddpkit` (no optional package)."""
import json
import subprocess
import sys

import pytest

from ddpkit.job.config import TrainConfig
from ddpkit.job.start import WORKER, plan, start
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
