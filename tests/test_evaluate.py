"""ddpkit.evaluate beside a user's own loop: RNG streams left alone, one model scored (rank 0's
BatchNorm statistics, as the checkpoint holds), regression scored out of the box (exact r2 across
ranks), metrics as torchmetrics objects or (sum, count) functions, with or without a step."""
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import ddpkit
from ddpkit.engines import comm
from ddpkit.training.batches import (default_loss, is_regression, loss_sum, regression_pair,
                            step_outputs, step_sums, sum_count)
from ddpkit.checkpoint.files import load_checkpoint
from ddpkit.base.errors import ConfigError
from ddpkit.checkpoint.sharded import consolidate


class Augmented(Dataset):
    """Rows with random noise added on every read: __getitem__ draws from the global torch RNG."""

    def __init__(self, n: int, seed: int = 0, every_stream: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x @ torch.randn(6, generator=g)
        self.every_stream = every_stream  # Python's and NumPy's global RNG too

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        scale = random.random() * np.random.rand() if self.every_stream else 0.1
        return self.x[i] + scale * torch.rand(6), self.y[i]


def regressor(out_dim: int = 1, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, out_dim))


def rows(n: int, k: int = 0, seed: int = 3):
    """A fixed tabular regression: (n, 6) inputs, float targets (n,) or (n, k)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, max(k, 1), generator=g) + 0.3 * torch.randn(n, max(k, 1), generator=g)
    return TensorDataset(x, y if k else y[:, 0])


def by_hand(model, data):
    """Single process, float64: mse, mae, r2 = 1 - SSE/SST around the mean of every target."""
    x, y = data.tensors
    with torch.no_grad():
        pred = model.eval()(x).reshape(y.shape).double()
    y = y.double()
    sse = float(((pred - y) ** 2).sum())
    sst = float(((y - y.mean()) ** 2).sum())
    return {"mse": sse / y.numel(), "mae": float((pred - y).abs().mean()), "r2": 1 - sse / sst,
            "count": y.numel()}


def rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


# ----------------------------------------------------------------------------- RNG streams

def test_evaluate_leaves_torch_python_and_numpy_rng_where_they_were():
    model = regressor()
    model.train()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    before = rng_states()
    ddpkit.evaluate(model, Augmented(10, every_stream=True), batch_size=4)
    after = rng_states()
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert all(np.array_equal(a, b) for a, b in zip(before[2], after[2]))
    assert model.training  # and the model is back in training mode


def test_evaluate_restores_rng_and_mode_when_it_fails():
    model = regressor()
    before = torch.get_rng_state()
    with pytest.raises(ConfigError):
        ddpkit.evaluate(model, Augmented(4), step=lambda m, b: torch.rand(1))
    assert torch.equal(torch.get_rng_state(), before) and model.training


def train_with_optional_eval(evaluate_mid_run: bool):
    """Two epochs on augmented rows, with dropout; perhaps an evaluation mid-epoch and after
    the first epoch. Returns the final parameters."""
    rt = ddpkit.setup(seed=0)
    model = rt.wrap(regressor())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = rt.loader(Augmented(48), batch_size=8, seed=0)
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            loss = F.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if evaluate_mid_run and i == 2:
                rt.evaluate(model, Augmented(13, seed=1), batch_size=4)
        if evaluate_mid_run:
            rt.evaluate(model, Augmented(7, seed=2), batch_size=4)
    return [p.detach().clone() for p in rt.unwrap(model).parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_evaluating_mid_training_leaves_the_training_bitwise_unchanged(world):
    plain = ddpkit.launch(train_with_optional_eval, world, False, timeout=120)
    evaluated = ddpkit.launch(train_with_optional_eval, world, True, timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(plain, evaluated))


# ----------------------------------------------------------------------------- BatchNorm

def bn_net() -> nn.Module:
    """Two BatchNorm layers, in float64: a sample's output in eval mode does not depend on the
    batch it is in, so what differs between world sizes is only the order of the sums."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                         nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).double()


def bn_rows(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g, dtype=torch.float64) * 2 + 1,
                         torch.randint(0, 3, (n,), generator=g))


def train_bn(out: str, engine: str, broadcast_buffers: bool, evaluate_mid_run: bool):
    """Two epochs, each rank's BatchNorm statistics updated on its own batches; then the
    evaluation a script prints (17 samples: uneven shards) and a checkpoint."""
    rt = ddpkit.setup(engine=engine, seed=0)
    model = rt.wrap(bn_net(), **({} if broadcast_buffers else {"broadcast_buffers": False}))
    net, val = rt.unwrap(model), bn_rows(17, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = rt.loader(bn_rows(36, seed=0), batch_size=12, seed=0)
    with rt.checkpointer(out, model=model, optimizer=opt, loader=loader,
                         every_epoch=False) as ckpt:
        for _ in range(ckpt.epoch, 2):
            for i, (x, y) in enumerate(loader):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.step()
                if evaluate_mid_run and i == 1:
                    rt.evaluate(model, val, batch_size=4)
        own = [b.clone() for b in net.buffers()]
        printed = rt.evaluate(model, val, batch_size=4)
        kept_own = all(torch.equal(a, b) for a, b in zip(own, net.buffers()))
        ckpt.save()
    every = comm.gather_object(own)  # each rank's statistics, as training left them
    drift = max(float((a - b).abs().max()) for r in every for a, b in zip(every[0], r))
    params = [p.detach().clone() for p in net.parameters()] if engine == "ddp" else None
    return {"printed": printed, "saved": str(ckpt.last_saved), "drift": drift,
            "kept_own": kept_own, "every": every, "params": params}


@pytest.mark.slow
@pytest.mark.parametrize("world,engine,broadcast_buffers", [
    (1, "ddp", True), (2, "ddp", True), (3, "ddp", True), (3, "ddp", False), (2, "fsdp", True),
    (3, "fsdp", True)])
def test_the_printed_metric_is_the_checkpoints_at_any_world_size(tmp_path, world, engine,
                                                                 broadcast_buffers):
    got = ddpkit.launch(train_bn, world, str(tmp_path), engine, broadcast_buffers, False,
                        timeout=180)
    assert (got["drift"] > 1e-3) == (world > 1)  # the ranks' statistics did drift apart
    assert got["kept_own"]  # and each rank trains on with its own
    state = (torch.load(consolidate(got["saved"], tmp_path / "model.pt")) if engine == "fsdp"
             else load_checkpoint(got["saved"])["model"])
    alone = bn_net()
    alone.load_state_dict(state)
    reference = ddpkit.evaluate(alone, bn_rows(17, seed=1), batch_size=4)
    assert got["printed"]["count"] == reference["count"] == 17
    assert got["printed"]["loss"] == pytest.approx(reference["loss"], rel=1e-12)
    assert got["printed"]["top1"] == reference["top1"]


@pytest.mark.slow
@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_evaluating_with_rank0s_buffers_leaves_the_training_bitwise_unchanged(
        tmp_path, broadcast_buffers):
    plain = ddpkit.launch(train_bn, 2, str(tmp_path / "a"), "ddp", broadcast_buffers, False,
                          timeout=180)
    evaluated = ddpkit.launch(train_bn, 2, str(tmp_path / "b"), "ddp", broadcast_buffers, True,
                              timeout=180)
    assert all(torch.equal(a, b) for a, b in zip(plain["params"], evaluated["params"]))
    for mine, theirs in zip(plain["every"], evaluated["every"]):  # every rank's statistics
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


# ----------------------------------------------------------------------------- regression

def test_is_regression_by_target_dtype_and_shape():
    b = 5
    assert is_regression(torch.randn(b), torch.randn(b))
    assert is_regression(torch.randn(b, 1), torch.randn(b))
    assert is_regression(torch.randn(b), torch.randn(b, 1))
    assert is_regression(torch.randn(b, 3), torch.randn(b, 3, dtype=torch.float64))
    assert not is_regression(torch.randn(b, 3), torch.randint(0, 3, (b,)))
    assert not is_regression(torch.randn(b, 1), torch.zeros(b, dtype=torch.long))
    assert not is_regression(torch.randn(b, 3), torch.randn(b))  # (B, 3) against (B,): no pair


def test_default_loss_is_mse_for_a_regression_and_cross_entropy_otherwise():
    out = torch.randn(6, 1, requires_grad=True)
    y = torch.randn(6, dtype=torch.float64)
    loss = default_loss(out, y)
    # (B, 1) against (B,) is paired, not broadcast to (B, B)
    assert torch.equal(loss, F.mse_loss(out.squeeze(1), y.float()))
    loss.backward()
    assert out.grad.shape == (6, 1)
    logits, labels = torch.randn(2, 4, 5), torch.tensor([[1, 2, -100, 0], [4, 4, 3, -100]])
    assert torch.equal(default_loss(logits, labels), F.cross_entropy(
        logits.reshape(-1, 5), labels.reshape(-1), ignore_index=-100))
    pred, target = regression_pair(torch.randn(3, 1, dtype=torch.float64), torch.randn(3))
    assert pred.dtype == target.dtype == torch.float64 and pred.shape == (3,)


@pytest.mark.parametrize("out_dim,k", [(1, 0), (3, 3)])
def test_regression_returns_mse_mae_r2_equal_to_the_hand_computed_ones(out_dim, k):
    model, data = regressor(out_dim), rows(23, k)
    got = ddpkit.evaluate(model, data, batch_size=5)
    ref = by_hand(model, data)
    assert set(got) == {"loss", "mse", "mae", "r2", "count"}  # no top-k for a regression
    assert got["count"] == ref["count"] == 23 * max(k, 1)
    for name in ("mse", "mae", "r2"):
        assert got[name] == pytest.approx(ref[name], rel=1e-6), name
    assert got["loss"] == got["mse"]


def test_one_dimensional_outputs_and_a_regression_loss_fn():
    data = rows(11)
    one_d = nn.Sequential(regressor(), nn.Flatten(0))  # (B,) outputs
    plain = ddpkit.evaluate(one_d, data, batch_size=4)
    by_sum = ddpkit.evaluate(one_d, data, batch_size=4, loss_fn=F.l1_loss)
    by_mean = ddpkit.evaluate(one_d, data, batch_size=4, loss_fn=nn.L1Loss())
    assert plain["r2"] == pytest.approx(by_hand(one_d, data)["r2"], rel=1e-6)
    assert by_sum["loss"] == pytest.approx(plain["mae"], rel=1e-6)
    assert by_mean["loss"] == pytest.approx(plain["mae"], rel=1e-6)
    total, count = loss_sum(one_d(data.tensors[0]).detach(), data.tensors[1])
    assert int(count) == 11 and float(total) / 11 == pytest.approx(plain["mse"], rel=1e-6)


def test_constant_targets_have_no_r2():
    data = TensorDataset(torch.randn(6, 6), torch.full((6,), 2.0))
    assert np.isnan(ddpkit.evaluate(regressor(), data)["r2"])


def test_integer_targets_with_class_logits_stay_a_classification():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(9, 6), torch.randint(0, 3, (9,)))
    got = ddpkit.evaluate(regressor(3), data, batch_size=4, topk=(1,))
    assert set(got) == {"loss", "top1", "count"}


def double_rows(n: int):
    """rows(n) and a regressor in float64: per-sample outputs do not depend on the batching, so
    what differs between world sizes is only the order of the float64 sums."""
    return regressor().double(), TensorDataset(*(t.double() for t in rows(n).tensors))


def regression_eval(n: int, batch: int):
    rt = ddpkit.setup()
    model, data = double_rows(n)
    return rt.evaluate(rt.wrap(model), data, batch_size=batch)


@pytest.mark.slow
def test_regression_scores_are_exact_on_1_2_and_3_processes():
    ref = by_hand(*double_rows(17))
    for world in (1, 2, 3):
        got = ddpkit.launch(regression_eval, world, 17, 4, timeout=120)
        assert got["count"] == 17
        for name in ("mse", "mae", "r2"):
            assert got[name] == pytest.approx(ref[name], rel=1e-12), (world, name)


# ----------------------------------------------------------------------------- metrics

def abs_error(pred, y):
    return (pred - y).abs().sum(), y.numel()


def hits(logits, y):
    return (logits.argmax(-1) == y).sum(), y.numel()


def test_sum_count_functions_are_reduced_like_the_loss():
    model, data = regressor(), rows(10)
    got = ddpkit.evaluate(model, data, batch_size=3, metrics={"abs": abs_error})
    assert got["abs"] == pytest.approx(got["mae"], rel=1e-6)  # pred reaches it shaped like y
    torch.manual_seed(0)
    labels = TensorDataset(torch.randn(9, 6), torch.randint(0, 3, (9,)))
    cls = ddpkit.evaluate(regressor(3), labels, batch_size=4, topk=(1,), metrics={"acc": hits})
    assert cls["acc"] * 100 == pytest.approx(cls["top1"], rel=1e-12)


def test_a_step_feeds_metrics_with_its_outputs_and_targets():
    model, data = regressor(), rows(10)

    def step(model, batch):
        x, y = batch
        pred = model(x).squeeze(1)
        return {"loss": (F.mse_loss(pred, y, reduction="sum"), y.numel()),
                "outputs": pred, "targets": y}

    got = ddpkit.evaluate(model, data, batch_size=3, step=step, metrics={"abs": abs_error})
    plain = ddpkit.evaluate(model, data, batch_size=3)
    assert set(got) == {"loss", "abs", "count"} and got["count"] == 10
    assert got["abs"] == pytest.approx(plain["mae"], rel=1e-6)
    assert got["loss"] == pytest.approx(plain["mse"], rel=1e-6)


@pytest.mark.slow
def test_a_step_feeds_a_torchmetrics_metric():
    torchmetrics = pytest.importorskip("torchmetrics")
    model, data = regressor(), rows(10)

    def step(model, batch):
        pred = model(batch[0]).squeeze(1)
        return {"n": (torch.tensor(0.0), len(pred)), "outputs": pred, "targets": batch[1]}

    got = ddpkit.evaluate(model, data, batch_size=3, step=step,
                          metrics={"R2": torchmetrics.R2Score()})
    assert got["R2"] == pytest.approx(by_hand(model, data)["r2"], rel=1e-5)


def test_metrics_with_a_step_that_gives_no_outputs_is_one_line():
    def step(model, batch):
        return {"loss": (torch.tensor(1.0), 1)}

    with pytest.raises(ConfigError) as exc:
        ddpkit.evaluate(regressor(), rows(4), step=step, metrics={"abs": abs_error})
    assert str(exc.value).startswith("metrics= with step=: the step must also return the "
                                     "batch's 'outputs' and 'targets' tensors")
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("metrics,message", [
    ({"loss": abs_error}, "metrics: the name 'loss' is one of evaluate's own results"),
    ({"x": 3}, r"metrics\['x'\] must be a torchmetrics Metric or a function .* type int$"),
    ({"x": lambda p, y: p.sum()}, r"metrics\['x'\] must return \(sum, count\)"),
])
def test_wrong_metrics_are_one_line(metrics, message):
    with pytest.raises(ConfigError, match=message):
        ddpkit.evaluate(regressor(), rows(4), metrics=metrics)


def test_step_sums_leave_out_outputs_and_targets():
    y = torch.ones(3)
    assert set(step_sums({"loss": (y.sum(), 3), "outputs": y, "targets": y})) == {"loss"}
    assert torch.equal(step_outputs({"outputs": y, "targets": 2 * y})[1], 2 * y)
    with pytest.raises(ConfigError, match=r"^step must return a dict of name -> \(sum, count\)"):
        step_sums({"outputs": y, "targets": y})
    total, count = sum_count((y.sum(), 3), "metrics['x']")
    assert float(total) == 3.0 and int(count) == 3


def test_evaluate_draws_nothing_from_the_global_generators_while_it_runs():
    """Not only restored after it: a DataLoader's iterator draws its base seed as it starts,
    from the global generator unless it has its own (what a forward or metric saw mid-way)."""
    seen = []
    model = regressor()
    model.register_forward_pre_hook(lambda m, args: seen.append(torch.get_rng_state()))
    data = TensorDataset(torch.randn(8, 6), torch.randn(8, 1))
    torch.manual_seed(7)
    before = torch.get_rng_state()
    ddpkit.evaluate(model, data, batch_size=4, resident=False)
    assert seen and all(torch.equal(before, state) for state in seen)
