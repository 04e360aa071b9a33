"""The fsdp engine (FSDP2 fully_shard) on CPU over gloo: the same training as DDP and as one
process, sharded checkpoints that resume exactly, on another world size, and across engines."""
import glob
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

import ddpkit
import resume_script
from ddpkit.engines.fsdp import shard_units
from ddpkit.base.errors import ConfigError
from ddpkit.job.models import build_model

from test_cli import ddpkit as run_cli, error_lines
from test_resume import assert_every_sample_once

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
KILL = signal.SIGKILL


def train(world, out, engine, *, resume=None, max_steps=None, batch=8, attempt=0, epochs=3):
    os.makedirs(out, exist_ok=True)
    return ddpkit.launch(resume_script.train, world, str(out), epochs, batch, resume, max_steps,
                         -1, -1, attempt, 2, KILL, None, engine, timeout=240)


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory):
    return train(2, tmp_path_factory.mktemp("fsdp_ref"), "fsdp")


def test_shard_units_are_the_repeated_blocks():
    gpt = build_model("gpt", 256, 1, context=16)
    assert shard_units(gpt) == list(gpt.blocks)
    resnet = build_model("resnet18", 10, 3)
    units = shard_units(resnet)
    assert len(units) == 8 and all(type(u).__name__ == "BasicBlock" for u in units)
    assert shard_units(gpt, units=[nn.LayerNorm])[0] is gpt.blocks[0].ln1


def test_fsdp_over_gloo_on_gpus_is_refused_before_the_group():
    # On an H100 (torch 2.11) 2 ranks sharing the GPU over gloo died by SIGSEGV under FSDP
    from datetime import timedelta

    from ddpkit.engines.fsdp import FSDPEngine
    from ddpkit.env.detect import ClusterEnv
    env = ClusterEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
    with pytest.raises(ConfigError, match="FSDP on GPUs needs NCCL"):
        FSDPEngine().start(env, torch.device("cuda", 0), "gloo", None, timedelta(seconds=5))


def test_fsdp_trains_like_ddp_and_one_process(tmp_path, fsdp_reference):
    ddp = train(2, tmp_path / "ddp", "ddp")
    one = train(1, tmp_path / "one", "ddp")
    for f, d, o in zip(fsdp_reference["params"], ddp["params"], one["params"]):
        torch.testing.assert_close(f, d, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(f, o, rtol=1e-5, atol=1e-6)


def test_fsdp_stop_and_resume_is_bitwise_exact(tmp_path, fsdp_reference):
    assert train(2, tmp_path, "fsdp", max_steps=17)["step"] == 17
    shards = sorted(glob.glob(str(tmp_path / "ckpt" / "ckpt-*.shards")))
    assert [os.path.basename(s) for s in shards] == ["ckpt-000000016.shards",
                                                      "ckpt-000000017.shards"]  # keep 2
    resumed = train(2, tmp_path, "fsdp", resume="auto", attempt=1)
    assert resumed["step"] == fsdp_reference["step"]
    assert all(torch.equal(a, b) for a, b in zip(resumed["params"], fsdp_reference["params"]))
    assert_every_sample_once(str(tmp_path), 3)


def test_kill_9_under_fsdp_resumes_bitwise(tmp_path, fsdp_reference):
    res = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc", "2", "--max-restarts",
                          "1", os.path.join(HERE, "resume_script.py"), "--out", str(tmp_path),
                          "--kill-rank", "1", "--kill-step", "9", "--engine", "fsdp"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["step"] == fsdp_reference["step"]
    assert all(torch.equal(a, b) for a, b in zip(final["params"], fsdp_reference["params"]))
    assert_every_sample_once(str(tmp_path), 3)


@pytest.mark.parametrize("world", [1, 3])
def test_sharded_checkpoint_reshards_onto_another_world_size(tmp_path, world):
    train(2, tmp_path, "fsdp", max_steps=5, batch=6, epochs=2)  # saved at step 4 by 2 ranks
    resumed = train(world, tmp_path, "fsdp", resume="auto", batch=6, attempt=1, epochs=2)
    assert resumed["step"] == 4 + (96 - 24) // 6 + 96 // 6
    assert_every_sample_once(str(tmp_path), 2)


def test_checkpoints_move_between_ddp_and_fsdp(tmp_path):
    ddp_ref = train(2, tmp_path / "ddp_ref", "ddp")
    train(2, tmp_path / "a", "ddp", max_steps=5)            # plain checkpoint at step 4 ...
    into_fsdp = train(2, tmp_path / "a", "fsdp", resume="auto", attempt=1)  # ... resumed sharded
    train(2, tmp_path / "b", "fsdp", max_steps=5)           # sharded checkpoint at step 4 ...
    into_ddp = train(2, tmp_path / "b", "ddp", resume="auto", attempt=1)    # ... resumed by DDP
    for got in (into_fsdp, into_ddp):
        assert got["step"] == ddp_ref["step"]
        for a, b in zip(got["params"], ddp_ref["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_consolidate_writes_a_plain_state_dict(tmp_path, fsdp_reference):
    out = tmp_path / "run"
    train(2, out, "fsdp")
    latest = sorted(glob.glob(str(out / "ckpt" / "ckpt-*.pt")))[-1]
    res = run_cli("ckpt", "consolidate", latest, str(tmp_path / "model.pt"))
    assert res.returncode == 0, res.stderr
    plain = nn.Sequential(nn.Linear(resume_script.FEATURES, 16), nn.Tanh(),
                          nn.Linear(16, resume_script.CLASSES))
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    for a, b in zip(plain.parameters(), fsdp_reference["params"]):
        assert torch.equal(a.detach(), b)


@pytest.mark.parametrize("what,said", [
    ("missing", "does not exist; give a sharded checkpoint's file"),
    ("plain", "is not a sharded checkpoint (no plain.shards/ with DCP metadata)"),
])
def test_consolidating_what_is_not_a_sharded_checkpoint_is_one_line(tmp_path, what, said):
    from ddpkit.checkpoint.sharded import consolidate
    path = tmp_path / f"{what}.pt"
    if what == "plain":
        torch.save({"model": {}}, path)
    with pytest.raises(ConfigError, match=re.escape(said)):
        consolidate(path, tmp_path / "out.pt")


def test_train_job_with_fsdp(tmp_path):
    res = run_cli("train", "--engine", "fsdp", "--nproc", "2", "--epochs", "3",
                  "--output", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "top-1" in res.stdout
    assert glob.glob(str(tmp_path / "checkpoints" / "ckpt-*.shards"))


def test_fsdp_bad_input_is_one_line(tmp_path):
    res = run_cli("train", "--engine", "fsdp", "--comm-hook", "fp16", "--output",
                  str(tmp_path), timeout=60)
    assert res.returncode == 2
    assert error_lines(res.stderr) == [
        "error: --comm-hook is a DDP gradient hook; FSDP reduces gradients in its own precision "
        "(--precision bf16 reduces in fp32)"]


def _int_params():
    rt = ddpkit.setup(engine="fsdp")
    model = nn.Linear(2, 2)
    model.register_parameter("steps", nn.Parameter(torch.zeros(1, dtype=torch.long),
                                                   requires_grad=False))
    try:
        rt.wrap(model)
    except ConfigError as exc:
        return str(exc)


def test_non_float_parameters_are_refused():
    assert ddpkit.launch(_int_params, 2, timeout=120) == (
        "FSDP shards floating-point parameters only; parameter 'steps' is torch.int64: make it "
        "a buffer, or use --engine ddp")


def test_a_sharded_checkpoint_of_another_model_is_one_line(tmp_path):
    train(2, tmp_path, "fsdp", max_steps=3)
    script = tmp_path / "other.py"
    script.write_text(
        "import sys, torch, ddpkit\n"
        "from ddpkit.training.loop import CheckpointPolicy, fit\n"
        "rt = ddpkit.setup(engine='fsdp')\n"
        "model = rt.wrap(torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Linear(5, 3)))\n"
        "data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.zeros(16).long())\n"
        f"policy = CheckpointPolicy({str(tmp_path / 'ckpt')!r}, resume='auto')\n"
        "fit(rt, model, torch.optim.SGD(model.parameters(), lr=0.1), rt.loader(data, 8),\n"
        "    epochs=1, checkpoint=policy, progress=False)\n")
    res = run_cli("run", "--nproc", "2", str(script), timeout=120)
    assert res.returncode != 0
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and "does not fit this model" in lines[0], res.stderr


def _evaluate_sharded(engine):
    rt = ddpkit.setup(engine=engine)
    torch.manual_seed(0)
    model = rt.wrap(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                                  nn.Linear(8, 3)))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(7, 4, generator=g),
                                          torch.randint(0, 3, (7,), generator=g))
    return rt.evaluate(model, data, batch_size=2, topk=(1,))  # 3 ranks: 2, 1 and 1 batches


def test_fsdp_evaluation_is_exact_with_uneven_shards():
    sharded = ddpkit.launch(_evaluate_sharded, 3, "fsdp", timeout=120)
    plain = ddpkit.launch(_evaluate_sharded, 1, "ddp", timeout=120)
    assert sharded["count"] == plain["count"] == 7
    assert sharded["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert sharded["top1"] == plain["top1"]


def _fit_with_everything(engine):
    from ddpkit.training.loop import fit
    from ddpkit.training.precision import Precision

    rt = ddpkit.setup(engine=engine, seed=0)
    torch.manual_seed(0)
    model = rt.wrap(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                  nn.Linear(16, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                          torch.randint(0, 3, (64,), generator=g))
    state = fit(rt, model, opt, rt.loader(data, batch_size=8), epochs=2, accum_steps=2,
                clip_norm=0.05, precision=Precision("fp32", rt.device), progress=False)
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for p in rt.unwrap(model).parameters()]
    return {"params": params, "norms": state.history[-1]["train/loss"]}


def test_fsdp_accumulation_and_clipping_match_ddp():
    fsdp = ddpkit.launch(_fit_with_everything, 2, "fsdp", timeout=180)
    ddp = ddpkit.launch(_fit_with_everything, 2, "ddp", timeout=180)
    for a, b in zip(fsdp["params"], ddp["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fsdp["norms"] == pytest.approx(ddp["norms"], rel=1e-5)


def test_language_model_job_under_fsdp_in_bf16_checkpoints_shards(tmp_path):
    res = run_cli("train", "--engine", "fsdp", "--precision", "bf16", "--model", "gpt",
                  "--data", "text", "--context", "32", "--epochs", "1", "--max-steps", "4",
                  "--output", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "ckpt-000000004.pt", "ckpt-000000004.shards", "latest"]


def test_fsdp_without_a_torch_process_group_is_one_line():
    from ddpkit.engines.fsdp import FSDPEngine
    from ddpkit.env.detect import ClusterEnv
    from ddpkit.base.wrap import WrapOptions

    two_ranks = ClusterEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
    with pytest.raises(ConfigError, match=r"^--engine fsdp needs torch.distributed's process "
                                          "group: start with ddpkit run / torchrun"):
        FSDPEngine().wrap(nn.Linear(2, 2), two_ranks, torch.device("cpu"), WrapOptions())
