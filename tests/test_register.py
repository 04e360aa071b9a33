"""The checkpointer's own pieces, in one process: your own Stateful objects and plain values
(checkpoint/registry.py, Checkpointer.register), when a save is due (checkpoint/cadence.py) and
how a stop is asked and said (checkpoint/stopping.py). With several ranks and real signals:
test_per_rank_extra.py, test_chaos.py."""
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpkit.base.errors import ConfigError
from ddpkit.checkpoint.cadence import Cadence
from ddpkit.checkpoint.files import load_checkpoint
from ddpkit.checkpoint.registry import stateful
from ddpkit.checkpoint.stopping import StopQuestions, last_save_ends_stop, stop_line
from test_loop import data, model, runtime


class Ema:
    """A user's own Stateful object: no base class, only the two methods."""

    def __init__(self, net):
        self.shadow = {k: v.detach().clone() for k, v in net.state_dict().items()}
        self.updates = 0

    def update(self, net):
        for k, v in net.state_dict().items():
            self.shadow[k].mul_(0.9).add_(v, alpha=0.1)
        self.updates += 1

    def state_dict(self):
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state):
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.updates = state["updates"]


def _run(directory, steps, *, register=None, extra=None):
    """Construct (it may resume), register after construction, train ``steps`` steps, close."""
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = rt.loader(data(), 8)
    ckpt = rt.checkpointer(directory, model=net, optimizer=opt, loader=loader, every_steps=3,
                           extra=extra)
    got = {name: ckpt.register(name, obj) for name, obj in (register or {}).items()}
    ema = got.get("ema")
    done = 0
    for x, y in loader:
        if done == steps:
            break
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        if isinstance(ema, Ema):
            ema.update(net)
        ckpt.step()
        done += 1
    ckpt.close()
    return ckpt, got


def test_an_object_registered_after_construction_is_restored_exactly(tmp_path, capsys):
    first, got = _run(tmp_path, 3, register={"ema": Ema(model())})
    saved = got["ema"].state_dict()
    assert load_checkpoint(first.last_saved)["extra_names"] == ["ema"]
    again, got = _run(tmp_path, 0, register={"ema": Ema(nn.Linear(1, 1))})
    assert again.resumed and got["ema"].updates == 3 and again.extra["ema"] is got["ema"]
    assert got["ema"].shadow.keys() == saved["shadow"].keys()
    assert all(torch.equal(got["ema"].shadow[k], v) for k, v in saved["shadow"].items())


def test_an_object_registered_in_a_fresh_run_keeps_its_state_and_the_next_save_holds_it(
        tmp_path):
    rt, net = runtime(), model()
    ckpt = rt.checkpointer(tmp_path, model=net, every_steps=1)
    ema = Ema(net)
    assert ckpt.register("ema", ema) is ema and ema.updates == 0
    ema.updates = 7
    ckpt.step()
    ckpt.close()
    assert load_checkpoint(ckpt.last_saved)["ema"]["updates"] == 7


def test_a_plain_value_registered_comes_back_and_a_list_is_refilled_in_place(tmp_path):
    _, got = _run(tmp_path, 3, register={"best": 0.25, "seen": [1, 2]})
    assert got == {"best": 0.25, "seen": [1, 2]}
    mine = []
    again, got = _run(tmp_path, 0, register={"best": 0.0, "seen": mine})
    assert got["best"] == 0.25 and again.extra["best"] == 0.25
    assert got["seen"] is mine and mine == [1, 2]


def test_extra_and_register_are_one_registry_and_old_style_extras_still_restore(tmp_path):
    _run(tmp_path, 3, extra={"best": 0.5}, register={"count": 4})
    again, got = _run(tmp_path, 0, extra={"best": 0.0})   # "count" not registered (yet)
    assert again.extra["best"] == 0.5 and again.extra["count"] == 4  # carried, as before
    assert again.register("count", 0) == 4                 # registered now: its saved value
    with pytest.raises(ConfigError) as err:
        again.register("best", 1.0)                        # given in extra=
    assert "\n" not in str(err.value) and "registered already" in str(err.value)


@pytest.mark.parametrize("name, obj, said", [
    ("model", Ema(nn.Linear(1, 1)), "taken by the checkpoint itself"),
    ("progress", 1, "taken by the checkpoint itself"),
    ("", 1, "non-empty string"),
    ("thing", object(), "neither Stateful"),
    ("pairs", {"a": [1, object()]}, "pairs['a'][1] (object)"),
])
def test_a_name_clash_or_an_object_a_checkpoint_cannot_hold_is_one_line(tmp_path, name, obj,
                                                                          said):
    ckpt = runtime().checkpointer(tmp_path, model=model())
    with pytest.raises(ConfigError) as err:
        ckpt.register(name, obj)
    ckpt.close()
    assert said in str(err.value) and "\n" not in str(err.value)
    assert name not in ckpt.extra


def test_stateful_is_pytorchs_protocol():
    from torch.distributed.checkpoint.stateful import Stateful
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for value in (net, opt, torch.optim.lr_scheduler.StepLR(opt, 1), Ema(net), 1.0, [1],
                  {"state_dict": 1}, torch.zeros(2)):
        assert stateful(value) == isinstance(value, Stateful), value

    class Half:  # attributes by those names that cannot be called: not Stateful here
        state_dict = load_state_dict = {}
    assert not stateful(Half())


# ---------------------------------------------------------------- when a save is due
def test_a_save_is_due_every_n_steps_at_an_epochs_last_batch_and_at_autos_measuring_step():
    every = Cadence(5, 0.0, every_epoch=False, mtbf_hours=24.0)
    assert [s for s in range(1, 16) if every.due(s, 0, False)] == [5, 10, 15]
    epochs = Cadence(0, 0.0, every_epoch=True, mtbf_hours=24.0)
    assert epochs.due(3, 0, at_last_batch=True) and not epochs.due(3, 0, False)
    auto = Cadence("auto", 0.0, every_epoch=False, mtbf_hours=24.0)
    assert auto.every_steps == 0 and auto.auto_mtbf == 24 * 3600.0
    assert [s for s in range(100, 140) if auto.due(s, 100, False)] == [120]  # resumed at 100


def test_a_save_is_due_every_m_minutes_by_the_clock():
    cadence = Cadence(0, 2.0, every_epoch=False, mtbf_hours=24.0)
    assert not cadence.due(1, 0, False)
    cadence.last_save_time -= 121
    assert cadence.due(2, 0, False)


def test_auto_chooses_the_interval_at_the_measuring_save_and_says_it_once(monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    cadence = Cadence("auto", 0.0, every_epoch=False, mtbf_hours=24.0)
    now = time.monotonic()
    cadence.saved(began=now - 0.5, measured=20, started=now - 2.5)  # 0.1 s a step, 0.5 s a save
    out = capsys.readouterr().out.splitlines()
    assert cadence.every_steps == 2939 and cadence.auto_mtbf is None
    assert len(out) == 1 and out[0].startswith("checkpoints every 2939 steps (4.9 min), chosen")
    cadence.saved(began=time.monotonic(), measured=40, started=now - 2.5)
    assert capsys.readouterr().out == ""   # the cadence line was said with the choice


def test_the_cadence_line_is_said_once_after_the_first_timed_save(monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    cadence = Cadence(10, 0.0, every_epoch=True, mtbf_hours=24.0)
    cadence.saved(began=time.monotonic(), measured=0, started=time.monotonic())  # not timed
    assert capsys.readouterr().out == ""
    for _ in range(2):
        cadence.saved(began=time.monotonic(), measured=10, started=time.monotonic() - 1.0)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("checkpoints every 10 steps: a failure loses")


# ---------------------------------------------------------------- stops
def test_every_step_asks_about_a_stop_until_the_calibration_then_every_quarter_second():
    questions = StopQuestions()
    assert all(questions.due(s, 0, time.monotonic(), installed=True) for s in range(1, 20))
    questions.due(20, 0, time.monotonic() - 20 * 0.01, installed=True)  # ~0.01 s a step
    assert 20 <= questions.every <= 26
    uninstalled = StopQuestions()
    uninstalled.due(20, 0, time.monotonic() - 0.2, installed=False)
    assert uninstalled.every == 1   # no handlers: nothing to settle


def test_the_stop_line_and_which_save_ends_a_stop():
    now = time.monotonic()
    path = Path("ckpt/ckpt-000000009.pt")
    line = stop_line(15, 9, " (epoch 2)", path, 9, Path("ckpt"), now - 1.0)
    assert line.startswith(f"stopped by SIGTERM at step 9 (epoch 2): checkpoint {path} saved 1.")
    assert line.endswith(" s after the signal")
    assert stop_line(10, 9, "", path, 6, Path("ckpt"), None) == \
        f"stopped by SIGUSR1 at step 9: checkpoint {path} (step 6) saved (the signal reached " \
        "another rank)"
    assert stop_line(15, 3, "", None, None, None, now) == "stopped by SIGTERM at step 3: nothing saved"
    assert last_save_ends_stop(100.0, 104.5) and not last_save_ends_stop(104.6, 104.5)
