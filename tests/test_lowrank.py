"""ddpkit's batched PowerSGD comm hook (``--comm-hook powersgd-batched``) on 2 real processes:
exact while it warms up and at full rank, every rank applying the same gradients, each step
equal to the algorithm computed in one process from both ranks' gradients (several buckets,
sizes that fill the square or not), error feedback that keeps what was not sent (rounding to
bf16 included), and a user's own loop that trains through DDP with it, over several buckets."""
import pytest
import torch

import ddpkit
from ddpkit.cost.lowrank import BatchedPowerSGD
from ddpkit.cost.model import hook_cost, square_side

import rankfns

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("numel", [50, 56, 64])    # padded, whole rows, a perfect square
def test_full_rank_is_the_exact_average_after_the_warm_up(numel):
    out = ddpkit.launch(rankfns.batched_powersgd_steps, 2, square_side(numel), 2, 5, [numel],
                        timeout=120)
    assert out["same"]
    for got, want in zip(out["applied"], out["exact"]):
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)


def _reference(grads, rank, start, numels):
    """The algorithm in one process from every rank's gradients: what each step applies."""
    memory, qs, applied = {}, {}, []
    for t, per_rank in enumerate(grads):
        if t < start:
            applied.append([torch.stack([g[i].float() for g in per_rank]).mean(0)
                            for i in range(len(numels))])
            continue
        step = []
        for i, n in enumerate(numels):
            side = square_side(n)
            r = min(rank, side)
            ms = []
            for k, g in enumerate(per_rank):
                m = memory.get((k, i), torch.zeros(side * side)).clone()
                m[:n] += g[i].float()
                ms.append(m.view(side, side))
            q = qs.get(i)
            if q is None:
                q = torch.randn(side, r, generator=torch.Generator().manual_seed(i))
            q = torch.linalg.qr(q, mode="reduced").Q
            p = torch.linalg.qr(sum(m @ q for m in ms), mode="reduced").Q
            qs[i] = sum(m.t() @ p for m in ms) / len(ms)
            approx = (p @ qs[i].t()).view(-1)
            for k, m in enumerate(ms):
                memory[k, i] = m.view(-1) - approx
            step.append(approx[:n])
        applied.append(step)
    return applied


def test_every_step_is_the_algorithm_computed_in_one_process_over_several_buckets():
    numels, rank, start, steps = [1000, 300, 49], 2, 2, 7   # buckets 0, 1, 2 as DDP hands them
    out = ddpkit.launch(rankfns.batched_powersgd_steps, 2, rank, start, steps, numels,
                        timeout=120)
    assert out["same"], "ranks applied different gradients"
    want = _reference(out["grads"], rank, start, numels)
    for t, (got, ref, exact) in enumerate(zip(out["applied"], want, out["exact"])):
        for i in range(len(numels)):
            torch.testing.assert_close(got[i], ref[i], rtol=1e-4, atol=1e-5)
            if t < start:
                assert torch.equal(got[i], exact[i])     # warm-up: plain all-reduce, averaged
            elif i == 0:
                rel = (got[i] - exact[i]).norm() / exact[i].norm()
                assert rel > 0.05, "rank 2 of a random 32 x 32 matrix cannot be exact"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_error_feedback_keeps_what_was_not_sent(dtype):
    # from the first compressed step on, what was applied plus the error left == the exact sum
    # of averages, the rounding of a bf16 bucket included (the warm-up's plain all-reduce is
    # DDP's own: in bf16 it rounds, as without a hook)
    numels, start, steps = [1000], 2, 12
    out = ddpkit.launch(rankfns.batched_powersgd_steps, 2, 1, start, steps, numels, dtype,
                        timeout=120)
    assert out["applied"][0][0].dtype == getattr(torch, dtype)
    applied = torch.stack([s[0].float() for s in out["applied"][start:]]).sum(0)
    exact = torch.stack([s[0] for s in out["exact"][start:]]).sum(0)
    torch.testing.assert_close(applied + out["error"][0], exact, rtol=1e-4, atol=1e-4)


def test_a_users_loop_trains_through_ddp_with_it_about_as_plain_all_reduce_does():
    out = ddpkit.launch(rankfns.train_with_hook, 2, "powersgd-batched", 30, 0.0002,
                        timeout=180)   # 0.0002 MB: the 195 parameters in several buckets
    plain = ddpkit.launch(rankfns.train_with_hook, 2, None, 30, timeout=180)
    assert out["same"], "ranks' parameters drifted apart"
    assert out["after"] != plain["after"], "the gradients were not compressed"
    assert out["before"] - out["after"] > 0.8 * (plain["before"] - plain["after"]), (out, plain)


def test_what_it_sends_and_what_it_refuses():
    cost = hook_cost("powersgd-batched", [(32, 1, 3, 3), (32,), (10, 256)], rank=2)
    side = square_side(32 * 9 + 32 + 2560)        # 2880 floats: a 54 x 54 matrix
    assert side == 54
    assert (cost.bytes, cost.calls) == (4 * 2 * 54 * 2, 2)
    assert cost.flops == 4 * 54 * 54 * 2 + 2 * 54 * 4
    assert hook_cost("powersgd-batched", [(3,)], rank=4).bytes == 4 * 2 * 2 * 2  # rank <= side
    with pytest.raises(ValueError, match="at least 2: DDP rebuilds its buckets"):
        BatchedPowerSGD(rank=2, start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="rank must be at least 1"):
        BatchedPowerSGD(rank=0)
