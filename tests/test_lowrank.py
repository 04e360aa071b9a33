"""ddpkit's batched PowerSGD comm hook (``--comm-hook powersgd-batched``) on 2 real processes:
exact while it warms up and at full rank, every rank applying the same gradient, error feedback
that loses nothing (what was applied plus the error left equals the exact sum of averages), and
a user's own loop that trains through DDP with it."""
import pytest
import torch

import ddpkit
from ddpkit.stepcost import hook_cost, square_side

import rankfns

pytestmark = pytest.mark.slow


def test_full_rank_is_the_exact_average_after_the_warm_up():
    numel = 50                                   # an 8 x 8 matrix (14 zeros of padding)
    out = ddpkit.launch(rankfns.batched_powersgd_steps, 2, square_side(numel), 1, 4, numel,
                        timeout=120)
    assert out["same"]
    for got, want in zip(out["applied"], out["exact"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_low_rank_compresses_and_error_feedback_keeps_what_it_left_out():
    numel, start, steps = 1000, 2, 8
    out = ddpkit.launch(rankfns.batched_powersgd_steps, 2, 1, start, steps, numel, timeout=120)
    assert out["same"], "ranks applied different gradients"
    for got, want in zip(out["applied"][:start], out["exact"][:start]):
        assert torch.equal(got, want)            # warm-up: plain all-reduce, averaged
    later = [(got - want).norm() / want.norm()
             for got, want in zip(out["applied"][start:], out["exact"][start:])]
    assert min(later) > 0.05, "rank 1 of a random 32 x 32 matrix cannot be exact"
    # error feedback: sum of applied + mean error left == sum of exact averages
    applied = torch.stack(out["applied"]).sum(0)
    exact = torch.stack(out["exact"]).sum(0)
    torch.testing.assert_close(applied + out["error"], exact, rtol=1e-4, atol=1e-4)


def test_a_users_loop_trains_through_ddp_with_it_about_as_plain_all_reduce_does():
    out = ddpkit.launch(rankfns.train_with_hook, 2, "powersgd-batched", 30, timeout=180)
    plain = ddpkit.launch(rankfns.train_with_hook, 2, None, 30, timeout=180)
    assert out["same"], "ranks' parameters drifted apart"
    assert out["after"] != plain["after"], "the gradients were not compressed"
    assert out["before"] - out["after"] > 0.8 * (plain["before"] - plain["after"]), (out, plain)


def test_what_it_sends():
    cost = hook_cost("powersgd-batched", [(32, 1, 3, 3), (32,), (10, 256)], rank=2)
    side = square_side(32 * 9 + 32 + 2560)        # 2880 floats: a 54 x 54 matrix
    assert side == 54
    assert (cost.bytes, cost.calls) == (4 * 2 * 54 * 2, 2)
    assert cost.flops == 4 * 54 * 54 * 2 + 2 * 54 * 4
    assert hook_cost("powersgd-batched", [(3,)], rank=4).bytes == 4 * 2 * 2 * 2  # rank <= side
