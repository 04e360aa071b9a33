"""Gradient accumulation in one process: step cadence, forced steps, equivalence, NaN skipping."""
import pytest
import torch
from torch import nn

from ddpkit.training.accumulate import Accumulator
from ddpkit.base.errors import ConfigError
from ddpkit.training.precision import Precision


class CountingSGD(torch.optim.SGD):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def _micro(acc, model, x, y, last=False):
    with acc.micro_step(last=last):
        with acc.precision.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
    return loss


@pytest.mark.parametrize("bad", [0, -1])
def test_steps_must_be_positive(bad):
    model = _model()
    with pytest.raises(ConfigError) as exc:
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=bad)
    assert str(exc.value) == f"accumulation steps must be >= 1, got {bad}"


def test_defaults():
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.steps == 1 and acc.precision.policy == "fp32"
    assert (acc.micro, acc.optimizer_steps, acc.skipped_steps, acc.stepped) == (0, 0, 0, False)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_one_optimizer_step_per_k_micro_steps(k):
    model = _model()
    opt = CountingSGD(model.parameters(), lr=0.01)
    acc = Accumulator(model, opt, steps=k)
    x, y = torch.randn(2, 5), torch.randn(2, 2)
    stepped = []
    for i in range(3 * k):
        assert acc.is_boundary() == ((i + 1) % k == 0)
        _micro(acc, model, x, y)
        stepped.append(acc.stepped)
        assert opt.calls == (i + 1) // k
        assert acc.micro == (i + 1) % k
    assert stepped == ([False] * (k - 1) + [True]) * 3
    assert acc.optimizer_steps == 3


def test_gradients_accumulate_between_steps_and_are_cleared_after():
    model = _model()
    opt = CountingSGD(model.parameters(), lr=0.01)
    acc = Accumulator(model, opt, steps=3)
    x, y = torch.randn(2, 5), torch.randn(2, 2)
    _micro(acc, model, x, y)
    g1 = model[0].weight.grad.clone()
    _micro(acc, model, x, y)
    assert torch.allclose(model[0].weight.grad, 2 * g1)  # same batch twice: twice the gradient
    _micro(acc, model, x, y)
    assert opt.calls == 1
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


def test_last_forces_a_step_and_restarts_the_window():
    model = _model()
    opt = CountingSGD(model.parameters(), lr=0.01)
    acc = Accumulator(model, opt, steps=4)
    x, y = torch.randn(2, 5), torch.randn(2, 2)
    _micro(acc, model, x, y)
    assert opt.calls == 0 and not acc.stepped
    assert acc.is_boundary(last=True)
    _micro(acc, model, x, y, last=True)
    assert opt.calls == 1 and acc.stepped and acc.micro == 0
    for _ in range(3):
        _micro(acc, model, x, y)
    assert opt.calls == 1  # a fresh window of 4 began after the forced step
    _micro(acc, model, x, y)
    assert opt.calls == 2


@pytest.mark.parametrize("k,b", [(2, 3), (4, 2), (3, 1)])
def test_k_micro_batches_equal_one_big_batch(k, b):
    torch.manual_seed(123)
    x, y = torch.randn(k * b, 5), torch.randn(k * b, 2)

    small = _model(1)
    opt_small = torch.optim.SGD(small.parameters(), lr=0.5)
    acc = Accumulator(small, opt_small, steps=k)
    for i in range(k):
        _micro(acc, small, x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
    assert acc.optimizer_steps == 1

    big = _model(1)
    opt_big = torch.optim.SGD(big.parameters(), lr=0.5)
    nn.functional.mse_loss(big(x), y).backward()
    opt_big.step()

    start = _model(1)
    for p_small, p_big, p0 in zip(small.parameters(), big.parameters(), start.parameters()):
        assert not torch.equal(p_big, p0)  # the step did something
        assert torch.allclose(p_small, p_big, atol=1e-6, rtol=0)


def test_equivalence_with_clipping_and_two_windows():
    torch.manual_seed(5)
    k, b = 2, 4
    x, y = torch.randn(2 * k * b, 5), 3 * torch.randn(2 * k * b, 2)
    small, big = _model(2), _model(2)
    acc = Accumulator(small, torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9), steps=k,
                      clip_norm=0.5)
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9)
    for w in range(2):
        for i in range(k):
            lo = (w * k + i) * b
            _micro(acc, small, x[lo:lo + b], y[lo:lo + b])
        big_x, big_y = x[w * k * b:(w + 1) * k * b], y[w * k * b:(w + 1) * k * b]
        nn.functional.mse_loss(big(big_x), big_y).backward()
        norm = float(nn.utils.clip_grad_norm_(big.parameters(), 0.5))
        opt_big.step()
        opt_big.zero_grad()
        assert acc.grad_norm == pytest.approx(norm, rel=1e-5)
    for p_small, p_big in zip(small.parameters(), big.parameters()):
        assert torch.allclose(p_small, p_big, atol=1e-6, rtol=0)


def test_backward_divides_by_k():
    w = nn.Parameter(torch.tensor([1.0]))
    acc = Accumulator(nn.ParameterList([w]), torch.optim.SGD([w], lr=0.1), steps=4)
    acc.backward((w * 8).sum())
    assert torch.equal(w.grad, torch.tensor([2.0]))


def test_skip_nonfinite_skips_nan_step_and_counts_it():
    model = _model()
    opt = CountingSGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, steps=2, skip_nonfinite=True)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(2, 5), torch.randn(2, 2)
    _micro(acc, model, x, y)
    _micro(acc, model, x, torch.full((2, 2), float("nan")))
    assert acc.skipped_steps == 1 and opt.calls == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())  # the bad gradients are dropped
    assert acc.micro == 0
    # the next window is clean and steps normally
    _micro(acc, model, x, y)
    _micro(acc, model, x, y)
    assert acc.skipped_steps == 1 and opt.calls == 1
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_skip_nonfinite_catches_inf():
    model = _model()
    opt = CountingSGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, steps=1, skip_nonfinite=True)
    with acc.micro_step():
        acc.backward(model(torch.randn(2, 5)).sum() * float("inf"))
    assert acc.skipped_steps == 1 and opt.calls == 0


def test_without_skip_nonfinite_nan_step_is_taken():
    model = _model()
    opt = CountingSGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, steps=1)
    _micro(acc, model, torch.randn(2, 5), torch.full((2, 2), float("nan")))
    assert acc.skipped_steps == 0 and opt.calls == 1
    assert torch.isnan(model[2].weight).all()


def test_bf16_precision_accumulates():
    model = _model()
    opt = CountingSGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, Precision("bf16", torch.device("cpu")), steps=2, clip_norm=1.0)
    x, y = torch.randn(2, 5), torch.randn(2, 2)
    _micro(acc, model, x, y)
    _micro(acc, model, x, y)
    assert opt.calls == 1 and acc.grad_norm is not None and acc.grad_norm > 0
    assert all(p.dtype is torch.float32 for p in model.parameters())
