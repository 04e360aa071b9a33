"""Asynchronous checkpoints (ddpkit.checkpoint.background): the saved file is the state at the
step boundary whatever the next steps change; the host buffers are reused, not grown; a failed
background write is one error at the next step naming what was kept; a stop waits for the write.
The multi-process kill -9 / SIGTERM resumes with async saves are in test_own_loop.py."""
import os
import re
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import ConfigError
from ddpkit.checkpoint.background import Snapshot
from ddpkit.checkpoint.files import load_checkpoint
from ddpkit.checkpoint.write import SaveError
from ddpkit.env.detect import ClusterEnv
from ddpkit.training.runtime import Runtime


def runtime(device="cpu"):
    return Runtime(ClusterEnv(), torch.device(device), None)


#: The snapshot's tests run on the CPU everywhere and on a GPU where there is one (there the host
#: buffers are pinned and the copies asynchronous until the snapshot synchronises).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def model(width=12):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3))


def held_writer(ckpt):
    """Hold the background write until the returned event is set."""
    go, write = threading.Event(), ckpt.background._write

    def slow(*args):
        assert go.wait(30)
        return write(*args)
    ckpt.background._write = slow
    return go


@pytest.mark.parametrize("device", DEVICES)
def test_the_saved_file_is_the_state_at_the_step_not_what_the_next_step_changes(tmp_path,
                                                                               device):
    rt, net = runtime(device), model().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = rt.loader(data(), 8)
    ckpt = rt.checkpointer(tmp_path, model=net, optimizer=opt, loader=loader, every_steps=3,
                           extra={"losses": []}, async_save=True)
    go = held_writer(ckpt)
    for x, y in loader:
        loss = nn.functional.cross_entropy(net(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.extra["losses"].append(float(loss.detach()))
        saved = ckpt.step()
        if saved is not None:
            break
    if device == "cuda":  # the weights and the momentum are copied into pinned memory (the
        # RNG states, CPU tensors, into plain memory)
        pinned = sum(b.nbytes() for b in ckpt.background.snapshot._buffers if b.is_pinned())
        assert pinned >= 2 * sum(p.nbytes for p in net.parameters())
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()]
    losses, position = list(ckpt.extra["losses"]), loader.state_dict()
    with torch.no_grad():  # what the next optimizer steps do, while the write is still held
        for p in net.parameters():
            p.add_(1.0)
            opt.state[p]["momentum_buffer"].mul_(-3)
    ckpt.extra["losses"].append(99.0)
    next(iter(loader))
    go.set()
    ckpt.close()
    state = load_checkpoint(saved)
    assert state["progress"]["step"] == 3 and state["losses"] == losses
    assert state["loader"] == position
    for name, value in expected.items():
        assert torch.equal(state["model"][name], value.cpu()), name
    saved_momentum = [s["momentum_buffer"] for s in state["optimizer"]["state"].values()]
    assert all(torch.equal(a, b.cpu()) for a, b in zip(saved_momentum, momentum))


@pytest.mark.parametrize("device", DEVICES)
def test_the_snapshot_keeps_shared_storage_and_reuses_its_buffers(device):
    w = torch.randn(4, 3, device=device)
    big = torch.randn(4096, 4096, device=device)  # 64 MB
    before = big.detach().clone().cpu()
    if device == "cuda":  # the copies queue behind a kernel of ~0.1 s: unless take() waits for
        torch.cuda._sleep(200_000_000)  # them, the host buffer is read before they land
    snap = Snapshot()
    first = snap.take({"a": w, "b": w, "row": w[1], "n": [1, {"x": 2.5}], "big": big})
    assert torch.equal(first["big"], before)  # read at once, from host memory
    big.mul_(-1)
    assert torch.equal(first["big"], before)
    assert first["a"].device.type == "cpu"
    assert first["a"].untyped_storage().is_pinned() == (device == "cuda")
    assert first["a"].untyped_storage().data_ptr() == first["b"].untyped_storage().data_ptr()
    assert torch.equal(first["row"], w[1].cpu()) and first["n"] == [1, {"x": 2.5}]
    assert snap.nbytes == w.untyped_storage().nbytes() + big.untyped_storage().nbytes()
    w.add_(1)
    assert not torch.equal(first["a"], w.cpu())
    second = snap.take({"a": w, "b": w, "row": w[1], "n": [1, {"x": 2.5}], "big": big})
    assert second["a"].untyped_storage().data_ptr() == first["a"].untyped_storage().data_ptr()
    assert torch.equal(second["a"], w.cpu())


def _rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_fifty_saves_reuse_the_host_memory_instead_of_growing_it(tmp_path):
    rt, net = runtime(), model(width=200_000)   # 8 MB of weights, 16 MB with momentum
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    ckpt = rt.checkpointer(tmp_path, model=net, optimizer=opt, every_steps=1, keep=2,
                           async_save=True)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    rss = []
    for step in range(50):
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        ckpt.step()
        rss.append(_rss_kb())
    ckpt.close()
    snapshot_mb = ckpt.background.snapshot.nbytes / 1e6
    weights_mb = sum(p.numel() * 4 for p in net.parameters()) / 1e6
    assert 2 * weights_mb <= snapshot_mb < 2 * weights_mb + 0.1, snapshot_mb  # + RNG states
    # RSS swings by about a snapshot from one step to the next (gradients, the writer's
    # buffers): compare the peaks. A snapshot allocated anew each save grows them 16 MB a save.
    grown_mb = (max(rss[-10:]) - max(rss[5:15])) / 1e3
    assert grown_mb < snapshot_mb, (grown_mb, rss)   # 35 more saves: less than one more copy
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000049.pt", "ckpt-000000050.pt", "latest"]


@pytest.mark.disk_size("160k")
def test_a_failed_background_write_is_one_error_at_the_next_step_naming_what_was_kept(small_disk):
    rt, net = runtime(), model(width=2000)   # ~80 kB a checkpoint: the second does not fit
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ckpt = rt.checkpointer(small_disk, model=net, optimizer=opt, every_steps=2, keep=3,
                           async_save=True)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    with pytest.raises(SaveError) as err:
        for _ in range(20):
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
    line = str(err.value)
    assert "\n" not in line and line.startswith("no space left on the device: checkpoint ")
    assert f"the newest intact checkpoint is {small_disk / 'ckpt-000000002.pt'}" in line
    # the write of step 4 failed: heard at step 5 if it had ended by then, else the save of
    # step 6 waits for it first
    assert ckpt.global_step in (5, 6)
    assert load_checkpoint(small_disk / "ckpt-000000002.pt")["progress"]["step"] == 2
    assert not any(p.name.endswith(".tmp") for p in small_disk.iterdir())


def test_closing_waits_for_the_write_and_a_loop_error_still_finishes_it(tmp_path):
    rt, net = runtime(), model()
    ckpt = rt.checkpointer(tmp_path / "a", model=net, every_steps=1, async_save=True)
    go = held_writer(ckpt)
    ckpt.step()
    threading.Timer(0.3, go.set).start()
    ckpt.close()    # returns once the file is complete
    assert load_checkpoint(tmp_path / "a" / "ckpt-000000001.pt")["progress"]["step"] == 1
    with pytest.raises(ZeroDivisionError):
        with rt.checkpointer(tmp_path / "b", model=net, every_steps=1, async_save=True) as ckpt:
            go = held_writer(ckpt)
            ckpt.step()
            threading.Timer(0.3, go.set).start()
            1 / 0
    assert (tmp_path / "b" / "latest").read_text() == "ckpt-000000001.pt\n"


class Opaque:   # pickles, but the safe loader would refuse it
    pass


def test_an_unloadable_extra_fails_the_async_save_on_the_next_question(tmp_path):
    rt, net = runtime(), model()
    ckpt = rt.checkpointer(tmp_path, model=net, every_steps=1, extra={"thing": Opaque()},
                           async_save=True)
    ckpt.step()
    with pytest.raises(ConfigError, match="objects that load_checkpoint would refuse"):
        ckpt.step()
    assert not any(p.name.endswith(".pt") for p in tmp_path.iterdir())


def test_young_daly_interval_and_what_it_costs():
    from ddpkit.checkpoint.advice import auto_cadence_line, young_daly_steps
    # sqrt(2 x 0.5 s x 86400 s) = 293.9 s of 0.1 s steps
    assert young_daly_steps(0.5, 0.1, 86400) == 2939
    assert young_daly_steps(0.0, 0.1, 86400) == 1          # a free save: every step
    assert young_daly_steps(8.0, 2.0, 4 * 3600) == 240     # 480 s of 2 s steps
    line = auto_cadence_line(240, 2.0, 8.0, 4 * 3600)
    assert line.startswith("checkpoints every 240 steps (8.0 min), chosen from a save that "
                           "blocks 8.00 s and a failure every 4 h")
    assert "saves take 1.7% of the time" in line and "loses 4.0 min of work" in line


def test_every_steps_auto_measures_the_save_at_step_20_then_keeps_the_chosen_interval(tmp_path,
                                                                                      capsys):
    import time
    rt, net = runtime(), model()
    # a failure every 0.36 s: the interval comes out at a few 10 ms steps
    ckpt = rt.checkpointer(tmp_path, model=net, every_steps="auto", mtbf_hours=1e-4, keep=100,
                           every_epoch=False)
    for _ in range(80):
        time.sleep(0.01)
        ckpt.step()
    ckpt.close()
    chosen = ckpt.every_steps
    said = [l for l in capsys.readouterr().out.splitlines() if "chosen from a save" in l]
    assert len(said) == 1 and said[0].startswith(f"checkpoints every {chosen} steps ("), said
    steps = sorted(int(p.name[5:14]) for p in tmp_path.glob("ckpt-*.pt"))
    assert steps[0] == 20 and 1 <= chosen < 60
    assert steps[1:] == [s for s in range(21, 81) if s % chosen == 0]


def test_bad_cadence_options_are_one_line(tmp_path):
    rt, net = runtime(), model()
    with pytest.raises(ConfigError, match="every_steps must be an integer >= 0 \\(0: off\\) or "
                                          "'auto', got 'often'"):
        rt.checkpointer(tmp_path, model=net, every_steps="often")
    for bad in (0, -1, float("nan"), float("inf"), "24"):
        with pytest.raises(ConfigError, match="mtbf_hours must be hours > 0 between failures"):
            rt.checkpointer(tmp_path, model=net, every_steps="auto", mtbf_hours=bad)


def test_the_docs_show_the_line_auto_prints():
    from ddpkit.checkpoint.advice import auto_cadence_line
    docs = os.path.join(os.path.dirname(__file__), "..", "docs", "checkpoints.md")
    with open(docs) as f:
        assert auto_cadence_line(2939, 0.1, 0.5, 24 * 3600) + "\n" in f.read()


def test_saves_that_keep_waiting_for_the_write_before_them_are_said_once(tmp_path, capsys):
    import time
    rt, net = runtime(), model()
    ckpt = rt.checkpointer(tmp_path, model=net, every_steps=1, async_save=True)
    write = ckpt.background._write
    ckpt.background._write = lambda *args: (time.sleep(0.2), write(*args))[1]  # a slow disk
    for _ in range(5):
        ckpt.step()
    ckpt.close()
    said = [l for l in capsys.readouterr().out.splitlines() if "waited" in l]
    assert len(said) == 1 and re.match(r"checkpoint: step 3 waited \d+\.\d s ", said[0]) and \
        said[0].endswith("for the previous background write (twice in a row): the writes take "
                         "longer than the time between saves; save less often"), said


def test_an_fsdp_background_save_gathers_the_rng_of_the_step_and_writes_it_after_the_shards(
        tmp_path):
    """FSDP's async save gathers every rank's RNG in the background (the step does not wait
    for the collective): what is written is the RNG at the save, whatever the step after it
    draws, and it is gathered before the shards are waited for."""
    import random

    import numpy as np

    from ddpkit.checkpoint.background import BackgroundSaver, gathered_rng
    from ddpkit.base.seed import rng_state
    written, order = {}, []

    def write(state, directory, step, keep):
        order.append("file")
        written.update(state)
        return directory / "ckpt.pt"
    saver = BackgroundSaver(write=write, say=lambda line: None)
    torch.manual_seed(3)
    expected = rng_state()
    first = gathered_rng(None, then=lambda: order.append("shards"))
    go = threading.Event()
    saver.start({"progress": {"step": 7}}, tmp_path, 7, keep=1,
                first=lambda: (go.wait(30), first())[1])
    torch.rand(5), random.random(), np.random.rand()  # the next step draws while it writes
    go.set()
    saver.finish()
    assert order == ["shards", "file"] and written["progress"] == {"step": 7}
    [got] = written["rng"]
    assert torch.equal(got["torch"], expected["torch"]) and got["python"] == expected["python"]
    assert torch.equal(got["numpy"][1], expected["numpy"][1])
    assert got["numpy"][2:] == expected["numpy"][2:]
