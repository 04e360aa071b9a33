"""Issue 55 row 18: state that differs between ranks, kept in a checkpoint's ``extra``.

A language model trained with truncated BPTT carries each rank's hidden state across batches
(``extra={"hidden": h}``); its batches, so its hidden state, differ by rank. The checkpoint held
rank 0's extras only and every rank restored them: after a kill -9 and a resume each rank
continued from rank 0's hidden state and the run ended elsewhere than the uninterrupted one,
without a word. Now an extra that differs is saved per rank and each rank gets its own back;
on another number of ranks it cannot be mapped: the resume line says each rank starts it from
its initial value. Extras equal on every rank are stored once, as before."""
import contextlib
import io
import os
import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
import own_loop_script
from ddpkit.engines import comm
from ddpkit.checkpoint.files import find_latest, load_checkpoint, save_checkpoint
from ddpkit.env.detect import ClusterEnv
from ddpkit.training.runtime import Runtime

pytestmark = pytest.mark.slow

SAMPLES, FEATURES, HIDDEN, BATCH = 64, 4, 6, 8   # 8 steps an epoch on any world size dividing 8
EPOCHS = 2


class TinyLM(nn.Module):
    """An LSTM cell and a head: each batch continues the hidden state of the batch before."""

    def __init__(self):
        super().__init__()
        self.cell, self.head = nn.LSTMCell(FEATURES, HIDDEN), nn.Linear(HIDDEN, 3)

    def forward(self, x, h, c):
        h, c = self.cell(x, (h, c))
        return self.head(h), h, c


def _data():
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g),
                         torch.randint(0, 3, (SAMPLES,), generator=g))


def _train(out, stop_at=None, engine="ddp", async_save=False):
    """Train (on every rank) until ``stop_at`` steps, as a kill would, or to the end; rank 0
    returns what every rank ends with and rank 0's output."""
    rt = ddpkit.setup(seed=0, deterministic=True, engine=engine)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            torch.manual_seed(0)
            model = rt.wrap(TinyLM())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = rt.loader(_data(), batch_size=BATCH, seed=7)
            per_rank = BATCH // rt.world_size
            ckpt = rt.checkpointer(os.path.join(out, "ckpt"), model=model, optimizer=opt,
                                   loader=loader, every_steps=3, keep=10, async_save=async_save,
                                   extra={"hidden": torch.zeros(2, per_rank, HIDDEN),
                                          "seen": 0.0, "lr": 0.1})
            resumed_hidden = ckpt.extra["hidden"].clone()
            for _ in range(ckpt.epoch, EPOCHS):
                for x, y in loader:
                    h, c = ckpt.extra["hidden"]
                    logits, h, c = model(x, h, c)
                    loss = nn.functional.cross_entropy(logits, y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    ckpt.extra["hidden"] = torch.stack([h, c]).detach()  # truncated BPTT
                    ckpt.extra["seen"] += float(x.sum())  # this rank's running sum
                    ckpt.step()
                    if ckpt.global_step == stop_at:  # killed: no more saves
                        ckpt.wait()  # (the save at step 6 is on disk)
                        return None
            ckpt.close()
            params = [p.full_tensor() if hasattr(p, "full_tensor") else p
                      for p in rt.unwrap(model).parameters()]
            mine = {"params": [p.detach().clone() for p in params], "resumed": resumed_hidden,
                    "hidden": ckpt.extra["hidden"], "seen": ckpt.extra["seen"]}
        every = comm.gather_object(mine)
        return every, said.getvalue()
    finally:
        rt.shutdown()


def _same(a, b):
    assert len(a) == len(b)
    for mine, theirs in zip(a, b):
        assert all(torch.equal(p, q) for p, q in zip(mine["params"], theirs["params"]))
        assert torch.equal(mine["hidden"], theirs["hidden"])
        assert mine["seen"] == theirs["seen"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Per engine, a 2-rank run killed after step 7; its checkpoint of step 6 written in the
    background. Each test resumes a copy."""
    made = {}

    def run(engine):
        if engine not in made:
            made[engine] = tmp_path_factory.mktemp(f"killed-{engine}")
            assert ddpkit.launch(_train, 2, str(made[engine]), 7, engine, True,
                                 timeout=240) is None
        return made[engine]
    return run


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_each_rank_resumes_its_own_hidden_state_and_ends_as_the_uninterrupted_run(
        tmp_path, killed, engine):
    whole, _ = ddpkit.launch(_train, 2, str(tmp_path / "whole"), None, engine, timeout=240)
    shutil.copytree(killed(engine), tmp_path / "cut")
    resumed, said = ddpkit.launch(_train, 2, str(tmp_path / "cut"), None, engine, timeout=240)
    _same(resumed, whole)  # before: rank 1 went on from rank 0's hidden state and sum
    assert "resumed from" in said and "extra" not in said, said   # no new line
    saved = load_checkpoint(tmp_path / "cut" / "ckpt" / "ckpt-000000006.pt")
    assert saved["extra_per_rank"] == ["hidden", "seen"]
    for rank in (0, 1):  # each rank started from its own hidden state
        assert torch.equal(resumed[rank]["resumed"], saved["hidden"][rank])
    assert not torch.equal(*saved["hidden"])
    assert saved["lr"] == 0.1  # the same on every rank: stored once, as before


def test_another_world_size_starts_per_rank_extras_afresh_with_one_line(tmp_path, killed):
    shutil.copytree(killed("ddp"), tmp_path, dirs_exist_ok=True)
    # one process: its batch of 8 could not continue a rank's hidden state of 4 (before: the
    # resume failed in the LSTM cell, shapes (8, 4) and (4, 6))
    (alone,), said = ddpkit.launch(_train, 1, str(tmp_path), None, timeout=240)
    assert torch.equal(alone["resumed"], torch.zeros(2, BATCH, HIDDEN))
    lines = [line for line in said.splitlines() if "extra" in line]
    assert len(lines) == 1 and "resumed at step 6 on 1 processes" in lines[0], said
    assert ("extras 'hidden', 'seen' differed per rank when saved on 2 ranks: each rank starts "
            "them from their initial values (given in extra=)") in lines[0]
    assert "Traceback" not in said


def test_fit_checkpoints_hold_no_per_rank_extras(tmp_path):
    """fit's extras (history, best, the epoch's sums over every rank) are the same on every
    rank: stored once, no line more."""
    args = own_loop_script.parser().parse_args(["--out", str(tmp_path), "--epochs", "1",
                                                "--hidden", "8", "--every", "4"])
    ddpkit.launch(_fit, 2, args, timeout=240)
    ckpts = sorted((tmp_path / "ckpt").glob("ckpt-*.pt"))
    mid = load_checkpoint(ckpts[0])  # mid-epoch: the epoch's sums are carried
    assert mid["progress"]["mid_epoch"] and mid["epoch_sums"] is not None
    for path in ckpts:
        ckpt = load_checkpoint(path)
        assert ckpt["extra_per_rank"] == [] and ckpt["extra_names"] == ["best", "epoch_sums",
                                                                        "history"]


def _fit(args):
    rt = ddpkit.setup(seed=0, deterministic=True)
    try:
        own_loop_script.with_fit(rt, args)
    finally:
        rt.shutdown()


def test_a_checkpoint_from_before_per_rank_extras_still_restores(tmp_path):
    rt = Runtime(ClusterEnv(), torch.device("cpu"), None)
    net = nn.Linear(2, 2)
    rt.checkpointer(tmp_path / "a", model=net, extra={"hidden": torch.ones(3), "n": 4}).save()
    state = find_latest(tmp_path / "a")[1]
    assert state["extra_per_rank"] == []
    del state["extra_per_rank"]  # the format before
    save_checkpoint(state, tmp_path / "b", step=0)
    again = rt.checkpointer(tmp_path / "b", model=nn.Linear(2, 2),
                            extra={"hidden": torch.zeros(3), "n": 0})
    assert torch.equal(again.extra["hidden"], torch.ones(3)) and again.extra["n"] == 4


class Holder:
    def __init__(self, value):
        self.t = torch.full((2,), value)


def test_the_digest_tells_equal_values_from_different_ones():
    from ddpkit.checkpoint.per_rank import digest
    assert digest({"h": torch.zeros(2, 3), "n": [1, 2.5]}) == \
        digest({"h": torch.zeros(2, 3), "n": [1, 2.5]})
    assert digest(torch.zeros(2, 3)) != digest(torch.zeros(3, 2))
    assert digest(torch.zeros(2)) != digest(torch.zeros(2, dtype=torch.float64))
    assert digest(torch.tensor([1.0, 2.0])) != digest(torch.tensor([1.0, 2.5]))
    assert digest({"b", "a", "c"}) == digest({"c", "a", "b"})  # not by string hashing order

    # objects by their pickle, their tensors by content (pickle's own keys change per call)
    assert digest(Holder(1.0)) == digest(Holder(1.0)) != digest(Holder(2.0))
