"""Any model, any batch: language-model logits, dict batches, Hugging Face-style outputs, user
step functions; sums and counts exact across ranks; one clear line for each wrong shape."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
import lmfns
from ddpkit.training.batches import (aligned, batch_size_of, cross_entropy, loss_sum, step_sums,
                            to_device, topk_hits)
from ddpkit.base.errors import ConfigError
from lmfns import VOCAB, DictTokens, HFStyle, TinyLM, tokens

CPU = torch.device("cpu")


def reference(model, data, pad=-100):
    """Single process, by hand: per-token cross-entropy and top-1 over non-padding targets."""
    x, y = data.tensors
    with torch.no_grad():
        logits = model(x).reshape(-1, VOCAB)
    y = y.reshape(-1)
    keep = y != pad
    losses = F.cross_entropy(logits[keep], y[keep], reduction="none").double()
    top1 = (logits[keep].argmax(-1) == y[keep]).double().mean() * 100
    return {"loss": float(losses.mean()), "count": int(keep.sum()), "top1": float(top1)}


# ----------------------------------------------------------------------------- pieces

def test_to_device_and_batch_size_of_any_structure():
    batch = {"ids": torch.zeros(4, 3), "extra": [torch.ones(4), ("t", torch.ones(2))]}
    moved = to_device(batch, CPU)
    assert moved.keys() == batch.keys() and torch.equal(moved["extra"][1][1], torch.ones(2))
    assert batch_size_of(batch) == 4 and batch_size_of((torch.zeros(5, 2), 1)) == 5
    with pytest.raises(ConfigError, match="cannot tell the batch size of a list"):
        batch_size_of(["a", "b"])


def test_loss_sum_counts_tokens_and_skips_padding():
    logits = torch.randn(2, 3, 5)
    y = torch.tensor([[1, -100, 2], [0, 4, -100]])
    total, count = loss_sum(logits, y)
    assert int(count) == 4
    keep = y.reshape(-1) != -100
    expected = F.cross_entropy(logits.reshape(-1, 5)[keep], y.reshape(-1)[keep], reduction="sum")
    torch.testing.assert_close(total, expected.double())
    # a plain lambda (a mean) and a loss object work too: mean x count
    lam, _ = loss_sum(logits, y, lambda a, b: F.cross_entropy(a, b, ignore_index=-100))
    obj, _ = loss_sum(logits, y, nn.CrossEntropyLoss(ignore_index=-100))
    torch.testing.assert_close(lam, total) and torch.testing.assert_close(obj, total)
    assert torch.equal(cross_entropy(logits, y), F.cross_entropy(
        logits.reshape(-1, 5), y.reshape(-1), ignore_index=-100))


def test_topk_any_shape_and_k_larger_than_classes():
    logits = torch.tensor([[[0.1, 0.9], [0.8, 0.2]]])  # (1, 2, 2)
    y = torch.tensor([[1, 1]])
    assert topk_hits(logits, y, (1, 5)).tolist() == [1.0, 2.0]


def test_mismatched_shapes_are_one_line():
    with pytest.raises(ConfigError) as exc:
        aligned(torch.randn(4, 7, 10), torch.zeros(4, dtype=torch.long))
    assert str(exc.value) == ("logits of shape (4, 7, 10) do not match targets of shape (4,): "
                              "expected logits (*, classes) for targets (*)")


@pytest.mark.parametrize("bad", [torch.tensor(1.0), {"loss": torch.tensor(1.0)},
                                 {"loss": (torch.ones(3), 3)}, {}, [1, 2]])
def test_a_step_that_returns_something_else_is_one_line(bad):
    with pytest.raises(ConfigError, match=r"^step must return a dict of name -> \(sum, count\)"):
        step_sums(bad)


# ----------------------------------------------------------------------------- evaluate

def test_language_model_evaluation_equals_the_hand_computed_token_mean():
    torch.manual_seed(0)
    model, data = TinyLM(), tokens(13, pad_every=5)
    ref = reference(model, data)
    got = ddpkit.evaluate(model, data, batch_size=4, topk=(1,))
    assert got["count"] == ref["count"] == 13 * lmfns.T - len(range(0, 13 * lmfns.T, 5))
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-12)
    assert got["top1"] == pytest.approx(ref["top1"], rel=1e-12)


def test_topk_empty_and_plain_lambda_loss():
    torch.manual_seed(0)
    out = ddpkit.evaluate(TinyLM(), tokens(5), batch_size=2, topk=(),
                          loss_fn=lambda logits, y: F.cross_entropy(logits, y))
    assert set(out) == {"loss", "count"} and out["count"] == 5 * lmfns.T


def test_step_function_sums_and_counts():
    torch.manual_seed(0)
    model, data = TinyLM(), tokens(9)

    def step(model, batch):
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
        hits = (logits.argmax(-1) == y).sum()
        return {"loss": (loss, y.numel()), "acc": (hits, y.numel())}

    got = ddpkit.evaluate(model, data, batch_size=4, step=step)
    ref = reference(model, data)
    assert got["count"] == ref["count"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)  # the step sums in float32
    assert got["acc"] * 100 == pytest.approx(ref["top1"], rel=1e-12)


def test_hugging_face_style_dict_batches_are_scored_with_the_models_shift():
    torch.manual_seed(0)
    model = HFStyle()
    data = DictTokens(7)
    got = ddpkit.evaluate(model, data, batch_size=3, topk=(1,))
    ids = data.ids
    out = model(ids, labels=ids)  # the model's own loss over all 7 sequences
    assert got["count"] == 7 * (lmfns.T - 1)  # shifted: T-1 targets per sequence
    assert got["loss"] == pytest.approx(float(out.loss.detach()), rel=1e-6)


def test_a_batch_the_model_cannot_take_is_one_line():
    with pytest.raises(ConfigError) as exc:
        ddpkit.evaluate(TinyLM(), DictTokens(3), batch_size=2)
    assert str(exc.value).startswith("the model cannot take the batch (a dict with keys "
                                      "['input_ids', 'labels']): ")


def test_empty_evaluation_data_is_one_line():
    empty = torch.utils.data.TensorDataset(torch.zeros(0, 4, dtype=torch.long),
                                           torch.zeros(0, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match="no targets were counted"):
        ddpkit.evaluate(TinyLM(), empty)


@pytest.mark.slow
@pytest.mark.parametrize("n,batch", [(7, 2), (13, 4)])
def test_language_model_evaluation_is_the_same_on_1_2_and_3_processes(n, batch):
    results = [ddpkit.launch(lmfns.lm_eval, world, n, batch, 4, timeout=120) for world in (1, 2, 3)]
    for r in results[1:]:
        assert r["count"] == results[0]["count"]
        assert r["loss"] == pytest.approx(results[0]["loss"], rel=1e-12)
        assert r["top1"] == pytest.approx(results[0]["top1"], rel=1e-12)
        assert r["top3"] == pytest.approx(results[0]["top3"], rel=1e-12)


@pytest.mark.slow
def test_hf_style_model_trains_on_dict_batches_the_same_on_1_and_2_processes():
    one = ddpkit.launch(lmfns.hf_fit, 1, 16, 8, 2, timeout=120)
    two = ddpkit.launch(lmfns.hf_fit, 2, 16, 8, 2, timeout=120)
    for a, b in zip(one["params"], two["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for h1, h2 in zip(one["history"], two["history"]):
        assert h1["eval/count"] == h2["eval/count"] == 16 * (lmfns.T - 1)
        assert h1["eval/loss"] == pytest.approx(h2["eval/loss"], rel=1e-5)
        assert h1["train/loss"] == pytest.approx(h2["train/loss"], rel=1e-5)
    assert one["history"][-1]["train/loss"] < one["history"][0]["train/loss"]  # it learns
    assert one["mean"] == 0.0 and two["mean"] == 0.5  # rt.mean: (0 + 1) / 2 on 2 ranks


@pytest.mark.slow
def test_logits_that_do_not_match_the_targets_end_training_with_one_line(tmp_path):
    from test_cli import ddpkit as run_cli, error_lines

    script = tmp_path / "bad_shapes.py"
    script.write_text(
        "import torch, ddpkit\n"
        "rt = ddpkit.setup()\n"
        "model = rt.wrap(torch.nn.Linear(4, 3))\n"
        "data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.zeros(16, 2).long())\n"
        "ddpkit.fit(rt, model, torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "           rt.loader(data, batch_size=8), epochs=1, progress=False)\n")
    res = run_cli("run", "--nproc", "2", str(script), timeout=120)
    assert res.returncode != 0
    assert error_lines(res.stderr) == [
        "error: logits of shape (4, 3) do not match targets of shape (4, 2): expected logits "
        "(*, classes) for targets (*)"], res.stderr
    assert "Traceback" not in res.stderr
