"""Issue 55, row 8: a checkpoint of another model placed as the newest file of a run. `--resume
auto` (``ddpkit train``, ``fit``, an own loop's ``rt.checkpointer``) skips it with one line naming
it and resumes from the newest checkpoint that is the run's; when none is, and for a path given
explicitly, the refusal stays one line (it used to be that refusal, with advice to switch the
whole run to the other model, whatever older checkpoints of the run lay beside it)."""
import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
from ddpkit.base.errors import ConfigError
from ddpkit.job.config import TrainConfig
from test_cli import ddpkit as run_cli, error_lines


def net(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def own_run(directory, steps, width=8, resume="auto"):
    """An own loop of ``steps`` steps checkpointing each; the step it resumed at."""
    rt = ddpkit.setup(seed=0)
    model = rt.wrap(net(width))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with rt.checkpointer(directory, model=model, optimizer=opt, every_steps=1,
                             resume=resume) as ckpt:
            start = ckpt.global_step
            for _ in range(steps):
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                ckpt.step()
        return start
    finally:
        rt.shutdown()


def test_an_own_loop_resumes_past_another_models_newest_checkpoint(tmp_path, capsys):
    own_run(tmp_path, 2)                                    # the run's: steps 1 and 2
    own_run(tmp_path / "other", 5, width=16)                # another model's, placed as newest
    (tmp_path / "other" / "ckpt-000000005.pt").rename(tmp_path / "ckpt-000000005.pt")
    capsys.readouterr()
    assert own_run(tmp_path, 1) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"warning: {tmp_path}/ckpt-000000005.pt does not belong to this run (another "
                   "model: 3 other shapes (0.weight, ...)): skipped; resuming from "
                   f"{tmp_path}/ckpt-000000002.pt"], err
    # named explicitly, it is refused (one line), not passed over
    with pytest.raises(ConfigError, match=r"^checkpoint model does not fit this run's model"):
        own_run(tmp_path / "fresh", 1, resume=tmp_path / "ckpt-000000005.pt")


def test_when_no_checkpoint_is_the_runs_the_newest_is_refused_as_before(tmp_path, capsys):
    own_run(tmp_path, 2, width=16)
    with pytest.raises(ConfigError, match=r"^checkpoint model does not fit this run's model"):
        own_run(tmp_path, 1)
    assert "does not belong" not in capsys.readouterr().err


def _checkpoint(directory, step, model):
    save_checkpoint({"model": {"w": torch.zeros(2)}, "progress": {"step": step},
                     "config": TrainConfig(model=model).to_dict()}, directory, step)


def test_ddpkit_trains_check_before_launch_passes_over_another_models_newest(tmp_path):
    from ddpkit.job.check import check_resume
    _checkpoint(tmp_path / "checkpoints", 5, "small_cnn")
    _checkpoint(tmp_path / "checkpoints", 9, "resnet18")    # placed: another model's
    check_resume(TrainConfig(model="small_cnn", resume="auto", output=str(tmp_path)))
    with pytest.raises(ConfigError, match="was written with --model resnet18, but this run asks "
                                          "for --model small_cnn"):   # named: refused
        check_resume(TrainConfig(model="small_cnn", output=str(tmp_path),
                                 resume=str(tmp_path / "checkpoints" / "ckpt-000000009.pt")))


@pytest.mark.slow
def test_ddpkit_train_resume_auto_skips_another_models_checkpoint_with_one_line(tmp_path):
    out = tmp_path / "run"
    res = run_cli("train", "--nproc", "1", "--epochs", "1", "--max-steps", "4",
                  "--ckpt-every-steps", "2", "--output", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    ckpts = out / "checkpoints"
    own = ckpts / "ckpt-000000004.pt"
    # another model's checkpoint, placed as the newest file of the run
    state = load_checkpoint(own)
    state["model"] = {k: torch.zeros(3, *v.shape) for k, v in state["model"].items()}
    state["config"]["model"], state["optimizer"] = "resnet18", None
    save_checkpoint(state, tmp_path / "elsewhere", 40)
    (tmp_path / "elsewhere" / "ckpt-000000040.pt").rename(ckpts / "ckpt-000000040.pt")
    res = run_cli("train", "--config", str(out / "config.json"), "--resume", "auto",
                  "--max-steps", "6")
    assert res.returncode == 0, res.stderr[-3000:]
    warned = [line for line in res.stderr.splitlines() if "does not belong" in line]
    assert warned == [f"warning: {ckpts}/ckpt-000000040.pt does not belong to this run (written "
                      "for model 'resnet18', this run's is 'small_cnn'): skipped; resuming from "
                      f"{own}"], res.stderr[-3000:]
    assert f"resumed from {own} at step 4" in res.stdout
    assert error_lines(res.stderr) == []
