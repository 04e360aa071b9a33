"""ddpkit.job.check: optional packages a request needs are named before any worker starts.

(The other impossible requests, end to end through `ddpkit train`, are in test_cli.py.)"""
import dataclasses
import importlib.util
import sys

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.job.check import check_config
from ddpkit.job.config import TrainConfig


def test_a_torchvision_model_without_torchvision_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^model 'torchvision:resnet18' needs torchvision; "
                                          r"pip install torchvision"):
        check_config(TrainConfig(model="torchvision:resnet18"), 2, cuda=False)


def test_an_image_folder_without_pillow_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ConfigError, match=r"^dataset 'imagefolder' needs Pillow .* pip install "
                                          r"pillow$"):
        check_config(TrainConfig(data="imagefolder", data_dir=str(tmp_path)), 2, cuda=False)


# ----------------------------------------------------------------------------- batch advice

@pytest.mark.parametrize("samples", [1, 2, 3, 5, 7, 64, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("accum", [1, 2, 3])
def test_batch_advice_is_true_for_the_given_numbers(samples, world, accum):
    """Every refused batch size names sizes that the same check then accepts, and no accepted
    size is refused (issue 22, row 7: the advice used to contradict itself)."""
    import re
    from ddpkit.job.check import micro_batch_size
    for batch in range(1, 2 * samples + 3):
        cfg = TrainConfig(data="synthetic", synthetic_samples=samples, batch_size=batch,
                          accum_steps=accum)
        fits = batch % (world * accum) == 0 and batch <= samples
        try:
            micro = micro_batch_size(cfg, world, samples)
        except ConfigError as exc:
            assert not fits, (batch, str(exc))
            message = str(exc)
            if samples < world * accum:  # no batch works: the fix is more data or fewer ranks
                assert "cannot give each of" in message
                continue
            advice = [int(n) for n in re.findall(r"--batch-size (\d+)", message.split("; use")[1])]
            assert advice, message
            for good in advice:
                micro_batch_size(TrainConfig(data="synthetic", synthetic_samples=samples,
                                             batch_size=good, accum_steps=accum), world, samples)
        else:
            assert fits and micro * world * accum == batch


def test_one_sample_on_two_processes_says_what_would_work():
    from ddpkit.job.check import micro_batch_size
    with pytest.raises(ConfigError) as exc:
        micro_batch_size(TrainConfig(data="synthetic", synthetic_samples=1, batch_size=4), 2, 1)
    assert str(exc.value) == ("the 1 training sample of 'synthetic' cannot give each of 2 "
                              "processes a sample: use --synthetic-samples 2 or more, or --nproc 1")


# ----------------------------------------------------------------------------- resume checks

def test_resuming_another_models_checkpoint_is_refused_before_anything_is_written(tmp_path):
    import torch
    from ddpkit.checkpoint.files import save_checkpoint
    from ddpkit.job.check import check_resume
    ckpts = tmp_path / "checkpoints"
    save_checkpoint({"model": {"w": torch.zeros(2)},
                     "config": TrainConfig(model="resnet18", output=str(tmp_path)).to_dict()},
                    ckpts, step=5)
    with pytest.raises(ConfigError) as exc:
        check_resume(TrainConfig(model="small_cnn", resume="auto", output=str(tmp_path)))
    assert "was written with --model resnet18, but this run asks for --model small_cnn" in \
        str(exc.value)
    check_resume(TrainConfig(model="resnet18", resume="auto", output=str(tmp_path)))  # fits
    check_resume(TrainConfig(model="small_cnn", resume=None, output=str(tmp_path)))   # no resume


def test_eval_only_needs_a_checkpoint_and_no_batch_that_splits(tmp_path):
    import torch
    from ddpkit.checkpoint.files import save_checkpoint
    from ddpkit.job.check import check_resume
    with pytest.raises(ConfigError, match="--eval-only evaluates a checkpoint: give --resume"):
        check_config(TrainConfig(eval_only=True), world_size=2, cuda=False)
    empty = TrainConfig(eval_only=True, resume="auto", output=str(tmp_path))
    with pytest.raises(ConfigError, match="no checkpoint in .* to evaluate"):
        check_resume(empty)
    # 64 does not split over 3 processes: refused for training, no matter for an evaluation
    with pytest.raises(ConfigError, match="cannot be split evenly over 3 processes"):
        check_config(TrainConfig(batch_size=64), world_size=3, cuda=False, samples=1438)
    check_config(dataclasses.replace(empty, batch_size=64), world_size=3, cuda=False, samples=1438)
    save_checkpoint({"model": {"w": torch.zeros(2)}, "config": TrainConfig().to_dict()},
                    tmp_path / "checkpoints", step=5)
    check_resume(empty)  # found: a run's checkpoint, whatever it said about eval_only
    # the seed orders the training data: no matter to an evaluation (the model still must fit)
    check_resume(dataclasses.replace(empty, seed=5))
    with pytest.raises(ConfigError, match="was written with --model small_cnn"):
        check_resume(dataclasses.replace(empty, model="resnet18"))
