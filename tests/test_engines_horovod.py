"""The Horovod engine (``--engine horovod``): same model as DDP, exact metrics, clear errors.

The multi-process tests run whenever ``horovod.torch`` imports (``make test`` builds it with
scripts/build_horovod.sh); the rest needs no Horovod.
"""
import os
import sys

import pytest
import torch

from ddpkit.engines import horovod as horovod_engine
from ddpkit.engines.horovod import HorovodEngine
from ddpkit.launchers import horovodrun as hvdrun
from ddpkit.base.wrap import WrapOptions
from ddpkit.checkpoint.files import find_latest
from ddpkit.job.config import TrainConfig
from ddpkit.base.errors import ConfigError
from ddpkit.job.check import check_config

from test_cli import ddpkit

HERE = os.path.dirname(os.path.abspath(__file__))
MISSING = horovod_engine.missing_reason()
needs_horovod = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


def test_started_by_horovodrun_is_detected_from_its_environment():
    assert horovod_engine.started_by_horovod({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"})
    assert not horovod_engine.started_by_horovod({"RANK": "1", "WORLD_SIZE": "2"})


def test_launch_args_use_gloo_on_this_host():
    args = hvdrun.launch_args(3, ["python", "-m", "ddpkit.job.train", "c.json"], 30)
    assert args == ["-np", "3", "-H", "localhost:3", "--gloo", "--start-timeout", "30",
                    "python", "-m", "ddpkit.job.train", "c.json"]


@pytest.mark.parametrize("options,fragment", [
    ({"comm_hook": "powersgd"}, "comm hook 'powersgd' is DDP-only"),
    ({"comm_hook": "bf16"}, "use --comm-hook fp16"),
    ({"sync_bn": True}, "--sync-bn is not supported with engine 'horovod'"),
])
def test_ddp_only_options_are_refused(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        HorovodEngine().check_options(WrapOptions(**options))
    HorovodEngine().check_options(WrapOptions(comm_hook="fp16"))  # Horovod's own fp16 compression


def test_missing_horovod_is_one_clear_config_error(monkeypatch):
    monkeypatch.setattr(horovod_engine, "missing_reason",
                        lambda: "horovod is not installed (x); build it with scripts/build_horovod.sh")
    with pytest.raises(ConfigError, match=r"^--engine horovod: horovod is not installed .*"
                                          r"scripts/build_horovod.sh"):
        check_config(TrainConfig(engine="horovod"), 2, cuda=False)


def test_horovod_engine_without_horovods_processes_is_refused_on_several_processes():
    from ddpkit.env.detect import ClusterEnv
    from ddpkit.engines import wrap_model
    with pytest.raises(ConfigError, match="needs Horovod's processes"):
        wrap_model(torch.nn.Linear(2, 2), ClusterEnv(rank=0, world_size=2), torch.device("cpu"),
                   "horovod")


def _final_weights(run_dir):
    return find_latest(os.path.join(run_dir, "checkpoints"))[1]["model"]


def _train(run_dir, *flags):
    return ddpkit("train", "--nproc", "2", "--epochs", "1",
                  "--deterministic", "--no-progress", "--output", str(run_dir), *flags,
                  timeout=300)


@needs_horovod
@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_horovod_trains_the_same_model_as_ddp(tmp_path, accum):
    # Gradients averaged by Horovod's optimizer vs DDP's buckets: with 2 ranks (a+b)/2 and
    # a/2+b/2 are the same floats, so the two engines agree to the last bit or very nearly.
    hvd = _train(tmp_path / "hvd", "--engine", "horovod", "--accum-steps", str(accum))
    assert hvd.returncode == 0, hvd.stderr[-3000:]
    assert "distributed_backend=horovod launcher=horovod" in hvd.stdout
    ddp = _train(tmp_path / "ddp", "--engine", "ddp", "--accum-steps", str(accum))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    a, b = _final_weights(tmp_path / "hvd"), _final_weights(tmp_path / "ddp")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    # The evaluation all-reduce ran through Horovod and its result is what was reported.
    top1 = [line for line in hvd.stdout.splitlines() if "final: top-1" in line]
    assert len(top1) == 1 and "on 359 test samples" in top1[0]


@needs_horovod
@pytest.mark.slow
def test_rank_utilities_run_on_horovod_collectives(tmp_path):
    from horovod.runner import run

    import rankfns
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("HOROVOD_GLOO_IFACE", "lo")
    outs = run(rankfns.comm_ops, args=(str(tmp_path),), num_proc=3, use_gloo=True,
               executable=sys.executable)
    out = outs[0]
    assert out["sum_int"] == 6 and isinstance(out["sum_int"], int)
    assert out["mean_float"] == pytest.approx(1.0)
    assert out["max_tensor"] == [2.0, 0.0] and out["min_num"] == 0.0
    assert out["bf16_sum"] == [3.0, 3.0]
    assert out["gathered"] == [[0], [0, 1], [0, 1, 2]]
    assert out["broadcast"] == "from 0" and out["world"] == (0, 3, True)
    assert out["first_seen"][0] == [] and all("rank0" in s for s in out["first_seen"][1:])


@needs_horovod
@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--comm-hook", "powersgd"], "error: comm hook 'powersgd' is DDP-only"),
    (["--nnodes", "2"], "error: --engine horovod runs on one node"),
])
def test_bad_horovod_input_is_one_line(tmp_path, flags, message):
    res = ddpkit("train", "--engine", "horovod", "--output", str(tmp_path), *flags)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(message), res.stderr
    assert "Traceback" not in res.stderr


@needs_horovod
@pytest.mark.slow
def test_a_user_script_under_horovodrun_must_wrap_its_optimizer():
    import subprocess

    script = os.path.join(HERE, "horovod_user_script.py")
    env = dict(os.environ, HOROVOD_GLOO_IFACE="lo")

    def horovodrun(mode):
        cmd = [sys.executable, "-c",
               "from horovod.runner.launch import run_commandline; run_commandline()",
               *hvdrun.launch_args(2, [sys.executable, script, mode])]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)

    ok = horovodrun("wrapped")
    assert ok.returncode == 0 and "ranks agree: True" in ok.stdout, ok.stderr[-2000:]
    # Forgetting rt.optimizer would train N different models silently: refused at step 1.
    bad = horovodrun("plain")
    assert bad.returncode != 0
    assert "error: under Horovod, pass the optimizer through rt.optimizer" in bad.stdout + bad.stderr
