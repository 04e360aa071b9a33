"""The fit loop and evaluation in one process (multi-process behaviour: test_multiprocess.py)."""
import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.env.detect import ClusterEnv
from ddpkit.training.evaluation import evaluate, topk_correct
from ddpkit.training.loop import CheckpointPolicy, Hook, fit
from ddpkit.training.log import RunLogger
from ddpkit.training.runtime import Runtime


def runtime():
    return Runtime(ClusterEnv(), torch.device("cpu"), None)


def data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


class Recorder(Hook):
    def __init__(self):
        self.events = []

    def on_fit_start(self, loop):
        self.events.append("start")

    def on_batch_end(self, loop, batch):
        self.events.append("batch")

    def on_step_end(self, loop, metrics):
        self.events.append(("step", loop.state.step, round(metrics["lr"], 6)))

    def on_epoch_end(self, loop, metrics):
        self.events.append(("epoch", metrics["epoch"]))

    def on_fit_end(self, loop):
        self.events.append("end")


def test_hooks_scheduler_per_step_and_accumulation():
    rt, net, rec = runtime(), model(), Recorder()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    state = fit(rt, net, opt, rt.loader(data(), 10), epochs=2, accum_steps=2, scheduler=sched,
                scheduler_interval="step", hooks=[rec], progress=False)
    assert state.step == 4  # 4 batches per epoch, 2 per optimizer step
    assert rec.events[0] == "start" and rec.events[-1] == "end"
    assert rec.events.count("batch") == 8
    steps = [e for e in rec.events if isinstance(e, tuple) and e[0] == "step"]
    assert [s[1] for s in steps] == [1, 2, 3, 4]
    assert [s[2] for s in steps] == [0.5, round(1 / 3, 6), 0.25, 0.2]  # stepped after each step
    assert ("epoch", 1) in rec.events and ("epoch", 2) in rec.events


def test_eval_best_tracking_history_and_jsonl(tmp_path):
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    logger = RunLogger(str(tmp_path), tensorboard=True)
    state = fit(rt, net, opt, rt.loader(data(), 8), epochs=3, eval_data=data(13, seed=1),
                logger=logger, log_every=1, progress=False)
    assert [h["epoch"] for h in state.history] == [1, 2, 3]
    assert all(h["eval/count"] == 13 for h in state.history)
    assert state.best == max(h["eval/top1"] for h in state.history)
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/loss" in r and "eval/top1" not in r for r in records) == state.step
    assert (tmp_path / "tensorboard").is_dir()


def test_checkpoint_every_minutes_and_max_steps(tmp_path):
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    policy = CheckpointPolicy(str(tmp_path), every_minutes=1e-9, every_epoch=False, keep=100)
    state = fit(rt, net, opt, rt.loader(data(), 10), epochs=5, checkpoint=policy, max_steps=6,
                progress=False)
    assert state.step == 6
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == [
        f"ckpt-{i:09d}.pt" for i in range(1, 7)]


def test_skip_nonfinite_steps_instead_of_stopping():
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bad = data()
    bad.tensors[0][3] = float("nan")   # one poisoned sample: its batch's gradients are NaN
    state = fit(rt, net, opt, rt.loader(bad, 10, shuffle=False), epochs=1, skip_nonfinite=True,
                progress=False)
    assert state.step == 4
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_nonfinite_loss_stops_naming_the_step():
    rt, net = runtime(), model()
    bad = data()
    bad.tensors[0][25] = float("inf")
    with pytest.raises(ddpkit.DDPKitError, match=r"loss is nan at step 3 \(epoch 1\)"):
        fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), rt.loader(bad, 10, shuffle=False),
            epochs=1, progress=False)


def test_on_gpus_the_loss_is_read_only_on_logging_steps(tmp_path, monkeypatch):
    # Reading a CUDA loss syncs the device; the loop checks it only when it is logged.
    from ddpkit.training import loop
    monkeypatch.setattr(loop._Fit, "_check_every_micro_step", property(lambda self: False))
    reads = []
    real = loop._Fit._check_finite
    monkeypatch.setattr(loop._Fit, "_check_finite",
                        lambda self, loss: reads.append(self.state.step) or real(self, loss))
    rt, net = runtime(), model()
    fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), rt.loader(data(), 10, shuffle=False),
        epochs=2, progress=False, logger=RunLogger(str(tmp_path)), log_every=3)
    assert reads == [2, 5], "read on steps 3 and 6 of 8 only"
    bad = data()
    bad.tensors[0][15] = float("inf")   # batch 2 -> NaN weights -> seen on logging step 3
    with pytest.raises(ddpkit.DDPKitError, match=r"loss is (nan|inf) by step 3 \(epoch 1\)"):
        fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), rt.loader(bad, 10, shuffle=False),
            epochs=2, progress=False, logger=RunLogger(str(tmp_path / "b")), log_every=3)


def test_bf16_channels_last_training_and_eval_run():
    rt = runtime()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 3)).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(0)
    images = TensorDataset(torch.randn(24, 1, 8, 8, generator=g), torch.randint(0, 3, (24,), generator=g))
    state = fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), rt.loader(images, 8), epochs=1,
                precision=ddpkit.Precision("bf16"), channels_last=True, eval_data=images,
                progress=False)
    assert state.history[-1]["eval/count"] == 24 and state.step == 3


def test_sync_batchnorm_model_evaluates_in_a_single_process():
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
    bn(torch.randn(32, 6))  # give the running statistics non-trivial values
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(bn)
    assert any(isinstance(m, nn.SyncBatchNorm) for m in sync.modules())
    plain = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
    plain.load_state_dict(sync.state_dict())
    assert evaluate(sync, data(17), batch_size=4) == evaluate(plain, data(17), batch_size=4)


def test_torchmetrics_metric_plugs_in():
    torchmetrics = pytest.importorskip("torchmetrics")
    net = model()
    f1 = torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro")
    acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    out = evaluate(net, data(23), batch_size=5, metrics={"f1": f1, "acc": acc})
    assert out["acc"] == pytest.approx(out["top1"] / 100, abs=1e-6)
    assert 0.0 <= out["f1"] <= 1.0


def test_topk_correct_counts():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.05, 0.15], [0.2, 0.3, 0.5]])
    target = torch.tensor([1, 2, 0])
    assert topk_correct(logits, target, (1, 2, 5)) == [1, 2, 3]


def test_fit_takes_a_fit_config_and_keywords_over_it():
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    cfg = ddpkit.FitConfig(epochs=3, accum_steps=2, progress=False)
    state = fit(rt, net, opt, rt.loader(data(), 10), cfg, epochs=1)  # keywords win
    assert (state.epoch, state.step) == (1, 2)
    with pytest.raises(ddpkit.DDPKitError, match="scheduler_interval must be 'step' or 'epoch'"):
        ddpkit.FitConfig(epochs=1, scheduler_interval="batch")


def test_a_compiled_model_checkpoints_plain_keys_that_load_into_a_plain_model(tmp_path):
    rt, net = runtime(), model()
    compiled = torch.compile(net, backend="eager")  # the eager backend: no C++ compiler needed
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    fit(rt, compiled, opt, rt.loader(data(), 10), epochs=1, progress=False,
        checkpoint=CheckpointPolicy(str(tmp_path)))
    assert ddpkit.unwrap(compiled) is net
    from ddpkit.checkpoint.files import find_latest
    saved = find_latest(tmp_path)[1]["model"]
    assert list(saved) == list(net.state_dict())  # no `_orig_mod.` prefix
    plain = model()
    plain.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                 net.state_dict().values()))


def test_a_checkpoint_with_compile_prefixed_keys_still_resumes(tmp_path):
    # ddpkit saved compiled models with `_orig_mod.` keys before unwrap learned torch.compile.
    from ddpkit.checkpoint.files import find_latest, save_checkpoint
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    fit(rt, net, opt, rt.loader(data(), 10), epochs=1, progress=False,
        checkpoint=CheckpointPolicy(str(tmp_path / "a")))
    state = find_latest(tmp_path / "a")[1]
    state["model"] = {f"_orig_mod.{k}": v for k, v in state["model"].items()}
    save_checkpoint(state, tmp_path / "b", step=state["progress"]["step"])
    again = model()
    opt2 = torch.optim.SGD(again.parameters(), lr=0.1)
    resumed = fit(rt, again, opt2, rt.loader(data(), 10), epochs=2, progress=False,
                  checkpoint=CheckpointPolicy(str(tmp_path / "b"), resume="auto"))
    assert resumed.epoch == 2 and resumed.history[0] == state["history"][0]


def test_fit_still_takes_the_checkpointed_config_dict_as_before():
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loop_seen = {}

    class Look(Hook):
        def on_fit_end(self, loop):
            loop_seen.update(loop.cfg.config)

    fit(rt, net, opt, rt.loader(data(), 10), epochs=1, config={"lr": 0.1}, hooks=[Look()],
        progress=False)
    assert loop_seen == {"lr": 0.1}


def test_fit_trains_and_evaluates_a_regression_out_of_the_box():
    # (B, 1) outputs against (B,) float targets: MSE to train, mse/mae/r2 to evaluate.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.01 * torch.randn(96, generator=g)
    rt = runtime()
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    state = fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.05), rt.loader(
        TensorDataset(x, y), 16), epochs=4, eval_data=TensorDataset(x, y), progress=False)
    first, last = state.history[0], state.history[-1]
    assert last["eval/count"] == 96 and "eval/top1" not in last
    assert last["eval/mse"] < first["eval/mse"] and last["eval/r2"] > 0.95
    assert last["eval/loss"] == pytest.approx(last["eval/mse"])


def test_a_checkpointer_in_a_user_loop_resumes_mid_epoch_exactly(tmp_path):
    # One process; the kill -9 and multi-process versions are in test_own_loop.py.
    def run(stop_at=None):
        rt, net = runtime(), model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        loader = rt.loader(data(), 8)
        ckpt = rt.checkpointer(tmp_path / "ckpt", model=net, optimizer=opt, loader=loader,
                               every_steps=3, extra={"seen": 0})
        for epoch in range(ckpt.epoch, 3):
            for x, y in loader:
                nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
                opt.zero_grad()
                ckpt.extra["seen"] += len(y)
                ckpt.step()
                if ckpt.global_step == stop_at:
                    return None
        ckpt.close()
        return net, ckpt
    whole, ckpt_whole = run()
    import shutil
    shutil.rmtree(tmp_path / "ckpt")
    assert run(stop_at=7) is None        # saved at step 6 (mid-epoch 1), then "crashed"
    resumed, ckpt = run()
    assert ckpt.resumed.endswith("ckpt-000000006.pt")
    assert ckpt.global_step == ckpt_whole.global_step == 15
    assert ckpt.extra["seen"] == ckpt_whole.extra["seen"] == 120
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)


def test_checkpointer_refuses_bad_options_in_one_line(tmp_path):
    rt, net = runtime(), model()
    with pytest.raises(ddpkit.ConfigError, match="every_steps must be an integer >= 0"):
        rt.checkpointer(tmp_path, model=net, every_steps=-1)
    with pytest.raises(ddpkit.ConfigError, match="extra names \\['model'\\] are taken"):
        rt.checkpointer(tmp_path, model=net, extra={"model": 1})


def test_max_steps_on_an_epochs_last_batch_then_resume_runs_each_epoch_end_once(tmp_path):
    def run(epochs, max_steps=None):
        rt, net = runtime(), model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        state = fit(rt, net, opt, rt.loader(data(), 10), epochs=epochs, max_steps=max_steps,
                    scheduler=sched, eval_data=data(8, seed=1), progress=False,
                    checkpoint=CheckpointPolicy(str(tmp_path), resume="auto"))
        return state, sched
    run(3, max_steps=4)                      # 4 batches an epoch: stops on epoch 1's last batch
    state, sched = run(3)
    assert [h["epoch"] for h in state.history] == [1, 2, 3]
    assert sched.last_epoch == 3


def test_a_checkpoint_written_by_fit_before_the_checkpointer_keeps_history_and_best(tmp_path):
    from ddpkit.checkpoint.files import find_latest, save_checkpoint
    rt, net = runtime(), model()
    fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), rt.loader(data(), 10), epochs=2,
        eval_data=data(8, seed=1), progress=False, checkpoint=CheckpointPolicy(str(tmp_path / "a")))
    state = find_latest(tmp_path / "a")[1]
    best = state.pop("best")  # the old format: best in "progress", no list of extras
    del state["extra_names"]
    state["progress"].update(best)
    save_checkpoint(state, tmp_path / "b", step=state["progress"]["step"])
    again = model()
    resumed = fit(rt, again, torch.optim.SGD(again.parameters(), lr=0.1), rt.loader(data(), 10),
                  epochs=3, eval_data=data(8, seed=1), progress=False,
                  checkpoint=CheckpointPolicy(str(tmp_path / "b"), resume="auto"))
    assert [h["epoch"] for h in resumed.history] == [1, 2, 3]
    assert resumed.history[:2] == state["history"]
    assert resumed.best >= best["best"]


def test_checkpointer_restores_list_and_dict_extras_in_place(tmp_path):
    rt, net = runtime(), model()
    losses, meta = [], {}
    ckpt = rt.checkpointer(tmp_path, model=net, extra={"losses": losses, "info": meta})
    losses += [1.0, 0.5]
    meta["lr"] = 0.1
    ckpt.save()
    mine, info = [], {}
    again = rt.checkpointer(tmp_path, model=model(), extra={"losses": mine, "info": info})
    assert again.extra["losses"] is mine and mine == [1.0, 0.5] and info == {"lr": 0.1}


# ----------------------------------------------------------------------------- issue 22 rows 8, 11

def test_skipped_steps_are_counted_and_the_epoch_loss_is_over_the_steps_taken(capsys):
    """Row 8: the epoch line and history count the skipped steps; the epoch loss is the mean over
    the steps taken (it was NaN as soon as one step was skipped)."""
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bad = data()
    bad.tensors[0][3] = float("nan")   # batch 1 of 4 (no shuffle): one step skipped per epoch
    state = fit(rt, net, opt, rt.loader(bad, 10, shuffle=False), epochs=2, skip_nonfinite=True,
                progress=False)
    assert [h["train/skipped_steps"] for h in state.history] == [1, 1]
    assert all(math.isfinite(h["train/loss"]) for h in state.history)
    assert [h["train/samples"] for h in state.history] == [40, 40]
    out = capsys.readouterr().out.splitlines()
    assert [line.endswith("skipped 1/4 steps (NaN/inf gradients)") for line in out] == [True, True]


def test_an_epoch_with_every_step_skipped_says_so(capsys):
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bad = data()
    bad.tensors[0][::10] = float("nan")  # a poisoned sample in every batch of 10
    before = [p.detach().clone() for p in net.parameters()]
    state = fit(rt, net, opt, rt.loader(bad, 10, shuffle=False), epochs=1, skip_nonfinite=True,
                progress=False)
    assert state.history[0]["train/skipped_steps"] == 4
    assert math.isnan(state.history[0]["train/loss"])  # no step was taken: no loss to report
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    err = capsys.readouterr().err
    assert "every step of epoch 1 had NaN/inf gradients and was skipped" in err


def test_max_steps_inside_an_epoch_ends_like_any_run(tmp_path, capsys):
    """Row 11: the run still evaluates, prints its line and records the history entry, and a
    resume with more steps continues the unfinished epoch."""
    def run(max_steps):
        rt, net = runtime(), model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        return fit(rt, net, opt, rt.loader(data(), 10), epochs=3, max_steps=max_steps,
                   eval_data=data(8, seed=1), eval_every=0, progress=False,
                   checkpoint=CheckpointPolicy(str(tmp_path), resume="auto"))
    state = run(6)                    # 4 steps an epoch: stops 2 steps into epoch 2
    assert state.step == 6 and state.epoch == 1
    last = state.history[-1]
    assert last["epoch"] == 2 and last["stopped_at_step"] == 6 and last["eval/count"] == 8
    assert "(max_steps reached at step 6; epoch 2 not finished)" in capsys.readouterr().out
    state = run(None)
    assert [h["epoch"] for h in state.history] == [1, 2, 3] and state.step == 12
    assert "eval/count" in state.history[-1] and "eval/count" not in state.history[1]


def test_max_steps_at_an_epoch_end_evaluates_even_when_eval_every_is_0():
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = fit(rt, net, opt, rt.loader(data(), 10), epochs=3, max_steps=4,
                eval_data=data(8, seed=1), eval_every=0, progress=False)
    assert [h["epoch"] for h in state.history] == [1] and state.history[0]["eval/count"] == 8


def test_a_full_disk_under_metrics_jsonl_is_one_warning_and_training_goes_on(tmp_path, capsys):
    """Issue 22, row 1's neighbour: /dev/full answers every write with ENOSPC."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    rt, net = runtime(), model()
    logger = RunLogger(str(tmp_path), tensorboard=False)
    state = fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), rt.loader(data(), 10),
                epochs=2, logger=logger, log_every=1, progress=False)
    assert state.step == 8 and len(state.history) == 2
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]


def test_a_full_disk_under_tensorboard_is_one_warning_and_training_goes_on(tmp_path, capsys):
    """Issue, third round, row 2: TensorBoard's writer raises ENOSPC from add_scalar, its
    flush and its close (its writer thread's error, raised again in the training thread)."""
    pytest.importorskip("torch.utils.tensorboard")
    import errno
    import os

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    rt, net = runtime(), model()
    logger = RunLogger(str(tmp_path), tensorboard=True)
    writer = logger._tb.file_writer.event_writer
    writer.add_event = writer.flush = writer.close = full
    state = fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), rt.loader(data(), 10),
                epochs=2, logger=logger, log_every=1, progress=False)
    logger.close()
    assert state.step == 8 and len(state.history) == 2
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
    assert "tensorboard" in warnings[0]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") > 8


def test_a_full_disk_under_results_json_is_one_line_naming_what_is_safe(tmp_path, capsys):
    # once: "its checkpoints are intact" also for a run that kept none, an empty results.json
    # left behind, and a suggested command that trained again from the start
    import json
    from ddpkit.checkpoint.write import SaveError
    from ddpkit.job.config import TrainConfig
    from ddpkit.job.train import _report
    from ddpkit.training.fitconfig import TrainState
    state = TrainState(1, 4, 90.0, 1, [{"epoch": 1, "train/loss": 0.5, "eval/top1": 90.0,
                                         "eval/count": 10}])
    for kept in (True, False):
        run = tmp_path / str(kept)
        (run / "checkpoints").mkdir(parents=True)
        if kept:
            (run / "checkpoints" / "ckpt-000000004.pt").write_bytes(b"")
        (run / "results.json.tmp").symlink_to("/dev/full")  # what the write goes through
        with pytest.raises(SaveError) as info:
            _report(TrainConfig(output=str(run)), state)
        line = str(info.value)
        assert line.startswith(f"cannot write {run}/results.json (No space left on device); ")
        assert not (run / "results.json").exists()  # none, rather than an empty one
        printed = [l for l in capsys.readouterr().out.splitlines() if l.startswith("results: ")]
        if kept:
            assert "its last checkpoint (step 4) is intact" in line and "--resume auto" in line
            assert printed == []
        else:
            assert "kept no checkpoint of its last step (step 4)" in line
            assert "--resume" not in line and "`results:` line above" in line
            assert json.loads(printed[0][len("results: "):])["best_top1"] == 90.0
