"""Behaviour across ranks with real processes (gloo on CPU) started by ddpkit.launch."""
import time

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.launch import LaunchError

import rankfns

pytestmark = pytest.mark.slow


def test_ddp_gradients_equal_single_process_full_batch():
    result = ddpkit.launch(rankfns.ddp_one_step, 2, timeout=120)
    model = rankfns.tiny_model()
    x, y = rankfns.full_batch()
    nn.functional.cross_entropy(model(x), y).backward()
    assert result["all_equal"], "ranks disagree on the averaged gradients"
    for got, want in zip(result["grads"], [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_rank_utilities(tmp_path):
    out = ddpkit.launch(rankfns.comm_ops, 3, str(tmp_path), timeout=120)
    assert out["sum_int"] == 6 and isinstance(out["sum_int"], int)
    assert out["mean_float"] == pytest.approx(1.0)
    assert out["max_tensor"] == [2.0, 0.0]
    assert out["min_num"] == 0.0
    assert out["bf16_sum"] == [3.0, 3.0]
    assert out["gathered"] == [[0], [0, 1], [0, 1, 2]]
    assert out["broadcast"] == "from 0"
    assert out["world"] == (0, 3, True)
    assert out["first_seen"][0] == []
    assert all("rank0" in seen for seen in out["first_seen"][1:])


def test_loader_owns_epochs_and_resumes_mid_epoch():
    per_rank = ddpkit.launch(rankfns.loader_epochs, 2, 10, 4, 3, 7, timeout=120)
    for epoch in range(3):
        shares = [r["epochs"][epoch] for r in per_rank]
        # 10 samples over 2 ranks: every sample seen, no padding needed
        assert sorted(shares[0] + shares[1]) == list(range(10))
    assert per_rank[0]["epochs"][0] != per_rank[0]["epochs"][1], "set_epoch was not applied"
    for r in per_rank:
        assert r["tail"] == r["epochs"][1][2:], "resume did not continue after 1 batch of 2"
        assert r["after"] == r["epochs"][2]
        assert r["len"] == 3


def test_exact_evaluation_awkward_sizes():
    dist = ddpkit.launch(rankfns.exact_eval, 3, 7, 2, timeout=120)
    single = rankfns.exact_eval(7, 2)
    assert dist["count"] == single["count"] == 7
    assert dist["top1"] == single["top1"] and dist["top2"] == single["top2"]
    assert dist["loss"] == pytest.approx(single["loss"], rel=1e-6)


def test_failing_rank_stops_everyone_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="(?s)rank 1 failed.*boom on rank 1"):
        ddpkit.launch(rankfns.raise_on_rank, 2, 1, timeout=120)
    assert time.monotonic() - start < 60


def test_timeout_stops_all_ranks():
    with pytest.raises(TimeoutError):
        ddpkit.launch(time.sleep, 2, 600, timeout=3)
