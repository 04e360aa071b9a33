"""Where a run stands and how a stop ends (checkpoint/position.py), in one process: the words of
the stop and resume lines, a finished run resumed, the grace warning. With real launchers and
signals: test_chaos.py."""
import os
import time

import torch
from torch import nn

from ddpkit.checkpoint.position import save_outlived_signal, where
from ddpkit.training.loop import CheckpointPolicy, fit
from test_loop import data, model, runtime


def test_the_words_for_a_position_count_epochs_from_1_and_say_an_epochs_end():
    assert where(None, False) == ""
    assert where({"epoch": 0, "samples_done": 0}, False) == " (epoch 1)"
    assert where({"epoch": 1, "samples_done": 16}, False) == " (epoch 2)"
    assert where({"epoch": 1, "samples_done": 16}, False, ", mid-epoch") == " (epoch 2, mid-epoch)"
    assert where({"epoch": 1, "samples_done": 40}, True, ", mid-epoch") == " (end of epoch 2)"
    assert where({"epoch": 3, "samples_done": 0}, False) == " (end of epoch 3)"  # not "epoch 4"


def test_a_stop_ends_with_a_save_complete_after_its_signal_and_only_then():
    assert save_outlived_signal(100.0, 104.5)       # under way when it came
    assert not save_outlived_signal(104.6, 104.5)   # before it: the stop saves
    assert save_outlived_signal(None, 104.5)        # the signal reached another rank
    assert not save_outlived_signal(100.0, None) and not save_outlived_signal(None, None)


def _own_loop(directory, epochs, stop_at=None):
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = rt.loader(data(), 8)  # 5 steps an epoch; every_epoch saves at its last batch
    ckpt = rt.checkpointer(directory, model=net, optimizer=opt, loader=loader)
    for _epoch in range(ckpt.epoch, epochs):
        for x, y in loader:
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            if ckpt.global_step == stop_at:
                return ckpt  # "killed": no close
    ckpt.close()
    return ckpt


def test_a_checkpoint_of_an_epochs_last_batch_resumes_at_its_end_not_mid_epoch(tmp_path, capsys):
    # Issue 55 row 19: it said "(epoch 1, mid-epoch)", and "(epoch 3, mid-epoch)" for a
    # finished 3-epoch run.
    _own_loop(tmp_path, 2, stop_at=7)
    capsys.readouterr()
    _own_loop(tmp_path, 2)
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path}/ckpt-000000005.pt at step 5 (end of epoch 1)\n" in out
    ckpt = _own_loop(tmp_path, 2)          # finished: the loop has nothing left
    assert ckpt.global_step == 10 and capsys.readouterr().out == \
        f"resumed from {tmp_path}/ckpt-000000010.pt at step 10 (end of epoch 2)\n"


def _fit(directory, max_steps=None, every_steps=0):
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return fit(rt, net, opt, rt.loader(data(), 10), epochs=2, max_steps=max_steps,
               eval_data=data(8, seed=1), progress=False,
               checkpoint=CheckpointPolicy(str(directory), every_steps=every_steps, resume="auto"))


def test_fit_resuming_a_finished_run_says_so_and_keeps_its_history(tmp_path, capsys):
    whole = _fit(tmp_path)
    capsys.readouterr()
    again = _fit(tmp_path)
    out = capsys.readouterr().out.splitlines()
    ckpt = f"{tmp_path}/ckpt-000000008.pt"
    assert out == [f"resumed from {ckpt} at step 8 (end of epoch 2)",
                   f"the run is complete: {ckpt} holds its last step (step 8, end of epoch 2 of "
                   "2); nothing left to train"]
    assert again.history == whole.history and again.step == 8


def test_a_run_ended_by_max_steps_resumed_gets_the_final_evaluation_its_checkpoint_missed(
        tmp_path, capsys):
    # saved at step 3 (every_steps) before the final evaluation: the checkpoint lacks it
    first = _fit(tmp_path, max_steps=3, every_steps=3)
    capsys.readouterr()
    again = _fit(tmp_path, max_steps=3)
    assert "holds its last step (step 3, max_steps 3)" in capsys.readouterr().out
    assert again.history[-1]["stopped_at_step"] == 3
    assert again.history[-1]["eval/loss"] == first.history[-1]["eval/loss"]


def test_a_save_slower_than_the_grace_period_warns_though_the_first_was_fast(
        tmp_path, monkeypatch, capsys):
    # a disk that slows down: the warning was only ever weighed at the first timed save
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "0.5")
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ckpt = rt.checkpointer(tmp_path, model=net, optimizer=opt, every_steps=1)
    real = os.fsync
    for step in range(3):
        if step == 2:
            monkeypatch.setattr(os, "fsync", lambda fd: (time.sleep(0.3), real(fd)))
        ckpt.step()
    ckpt.close()
    warned = [line for line in capsys.readouterr().out.splitlines() if "grace" in line]
    assert len(warned) == 1 and "kills the workers 0.5 s after it" in warned[0], warned
