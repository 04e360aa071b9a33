"""The language-model job: `ddpkit train --model gpt --data text`, the byte-level text data and the
small GPT; validation loss and perplexity exact at any world size."""
import json
import math

import pytest
import torch

from ddpkit.base.errors import ConfigError
from ddpkit.job.config import TrainConfig
from ddpkit.job.check import check_config
from ddpkit.job.datasets import build_dataset
from ddpkit.job.models import build_model
from ddpkit.job.text import TextBytes, default_corpus, text
from ddpkit.data.resident import choose_resident, resident_batches

from test_cli import ddpkit, error_lines

CORPUS = ("It was the best of times, it was the worst of times, it was the age of wisdom, it "
          "was the age of foolishness, it was the epoch of belief, it was the epoch of "
          "incredulity, it was the season of Light, it was the season of Darkness. ") * 40


def test_windows_pair_each_byte_with_the_next():
    ds = TextBytes(torch.tensor(list(b"hello world, hello ddpkit"), dtype=torch.uint8), 8)
    assert len(ds) == 3
    x, y = ds[1]
    assert bytes(x.tolist()) == b"rld, hel" and bytes(y.tolist()) == b"ld, hell"
    with pytest.raises(IndexError):
        ds[3]


def test_resident_windows_equal_the_items():
    ds = text(train=True, context=16)
    data = choose_resident(ds, torch.device("cpu"), "on")
    order = [5, 0, 17, 3]
    (x, y), = list(resident_batches(data, order, 4, False, 0, 0))
    for row, i in enumerate(order):
        assert torch.equal(x[row], ds[i][0]) and torch.equal(y[row], ds[i][1])


def test_default_corpus_is_ddpkits_own_sources_split_90_10():
    files = default_corpus()
    assert any(p.name == "batches.py" for p in files)
    train, val = text(train=True), text(train=False)
    total = sum(p.stat().st_size for p in files) + len(files) - 1  # joined by newlines
    assert len(train.data) + len(val.data) == total
    assert len(train.data) == int(total * 0.9)


def test_text_from_a_directory_and_bad_directories(tmp_path):
    (tmp_path / "a.txt").write_text(CORPUS)
    (tmp_path / "skip.bin").write_bytes(b"\0" * 1000)
    ds = build_dataset("text", tmp_path, train=True, context=32)
    assert len(ds.data) == int(len(CORPUS) * 0.9)
    with pytest.raises(ConfigError, match="does not exist"):
        text(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no text files under"):
        text(tmp_path / "empty")
    with pytest.raises(ConfigError, match="fewer than one window"):
        text(tmp_path / "a.txt", train=False, context=len(CORPUS))


def test_gpt_takes_tokens_and_gives_logits_per_position():
    model = build_model("gpt", 256, 1, context=32)
    assert model(torch.randint(0, 256, (3, 32))).shape == (3, 32, 256)
    with pytest.raises(ConfigError, match="exceed its context of 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("cfg,message", [
    (TrainConfig(model="gpt"), "model 'gpt' takes token sequences, use --data text"),
    (TrainConfig(data="text"), "--data text needs a language model: use --model gpt"),
])
def test_models_and_data_must_pair(cfg, message):
    with pytest.raises(ConfigError) as exc:
        check_config(cfg, 1, cuda=False)
    assert str(exc.value).startswith(message)


def _train(tmp_path, name, nproc, *extra):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    out = tmp_path / name
    res = ddpkit("train", "--model", "gpt", "--data", "text", "--data-dir", str(corpus),
                 "--context", "32", "--batch-size", "8", "--epochs", "1",
                 "--optimizer", "adamw", "--lr", "1e-3", "--nproc", str(nproc),
                 "--output", str(out), *extra, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads((out / "results.json").read_text())["final"]


@pytest.mark.slow
def test_language_model_job_evaluates_the_same_on_1_and_2_processes(tmp_path):
    res1, one = _train(tmp_path, "one", 1)
    res2, two = _train(tmp_path, "two", 2)
    assert one["eval/count"] == two["eval/count"] == (len(CORPUS) - int(len(CORPUS) * 0.9) - 1) \
        // 32 * 32  # every validation token once, whatever the world size
    assert two["eval/loss"] == pytest.approx(one["eval/loss"], rel=1e-4)
    assert two["eval/perplexity"] == pytest.approx(math.exp(two["eval/loss"]), rel=1e-9)
    assert "final: validation loss" in res2.stdout and "perplexity" in res2.stdout


def test_image_model_on_text_is_one_line(tmp_path):
    res = ddpkit("train", "--data", "text", "--output", str(tmp_path), timeout=60)
    assert res.returncode == 2
    assert error_lines(res.stderr) == [
        "error: --data text needs a language model: use --model gpt (model 'small_cnn' takes "
        "images)"]
