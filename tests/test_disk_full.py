"""Issue 22, row 1: the disk fills up during a checkpoint. One line from rank 0 (no space, the
size, the newest intact checkpoint, how to resume), every rank ends, the partial files are gone
and the previous checkpoint still loads: under `ddpkit train` on a small tmpfs, and in a user's
own loop (plain and FSDP) under a file-size limit, which needs no root."""
import contextlib
import errno
import os
import pickle
import re
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.engines import comm
from ddpkit.checkpoint.files import find_latest, load_checkpoint
from ddpkit.checkpoint.write import disk_full, no_space
from ddpkit.base.errors import DDPKitError
from ddpkit.checkpoint.sharded import _bare_disk_full

import forkrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def _ddpkit(*args, timeout=120):
    return forkrun.ddpkit(*args, timeout=timeout)


def test_ddpkit_train_on_a_full_disk_is_one_line_and_resumes_from_the_newest_checkpoint(
        small_disk):
    out = small_disk / "run"
    res = _ddpkit("train", "--nproc", "2", "--epochs", "1", "--ckpt-every-steps", "3",
                  "--ckpt-keep", "4", "--max-steps", "20", "--output", str(out))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith(("error:", "[rank"))]
    assert len(errors) == 1, res.stderr
    kept = sorted((out / "checkpoints").glob("ckpt-*.pt"))  # 3, 6, 9 (287 kB each) fit in 1 MB
    newest, failed = kept[-1], f"ckpt-{int(kept[-1].stem[5:]) + 3:09d}.pt"
    assert errors[0].startswith("error: no space left on the device: checkpoint "
                                f"{out}/checkpoints/{failed} needs about "), errors[0]
    assert f"the newest intact checkpoint is {newest}" in errors[0]
    assert "or keep fewer checkpoints: keep=3 / --ckpt-keep 3 holds 3 on disk" in errors[0]
    assert errors[0].endswith(f"resume with `ddpkit train --config {out}/config.json "
                              "--resume auto`")
    leftovers = [p.name for p in out.rglob("*") if p.name.endswith(".tmp") or failed in p.name]
    assert leftovers == []
    assert not (out / "ddpkit.lock").exists()  # the run directory is free again
    step = int(newest.stem[5:])
    assert load_checkpoint(newest)["progress"]["step"] == step
    assert find_latest(out / "checkpoints")[0] == newest

    # Space freed: the command from the line continues the run from that checkpoint.
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    res = _ddpkit("train", "--config", str(out / "config.json"), "--resume", "auto",
                  "--max-steps", str(step + 3))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {newest}" in res.stdout


def test_keeping_fewer_checkpoints_takes_less_disk_as_the_advice_says(small_disk):
    # once pruned only after a successful save: keep 2 and 1 failed like 3; now the older ones
    # go first (the newest complete one stays), so keep 3 fits 1 MB (and the advice holds)
    for keep in ("3", "2", "1"):
        out = small_disk / f"run{keep}"
        res = _ddpkit("train", "--nproc", "2", "--epochs", "1", "--ckpt-every-steps", "3",
                      "--ckpt-keep", keep, "--max-steps", "20", "--output", str(out))
        assert res.returncode == 0, (keep, res.stderr[-3000:])
        kept = sorted((out / "checkpoints").glob("ckpt-*.pt"))
        assert len(kept) == int(keep) and kept[-1].name == "ckpt-000000020.pt", kept
        shutil.rmtree(out)


@pytest.mark.disk_size("400k")
def test_a_full_disk_with_one_checkpoint_on_it_says_the_space_needed_not_keep_fewer(small_disk):
    # issue 55, row 9: keeping fewer would delete nothing (the one checkpoint stays)
    out = small_disk / "run"
    res = _ddpkit("train", "--nproc", "1", "--epochs", "1", "--ckpt-every-steps", "3",
                  "--max-steps", "20", "--output", str(out))
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith(("error:", "[rank"))]
    assert len(errors) == 1 and "keep fewer checkpoints: keep=" not in errors[0], res.stderr
    assert [p.name for p in (out / "checkpoints").glob("ckpt-*.pt")] == ["ckpt-000000003.pt"]
    assert re.search(rf"needs about [\d.]+ kB \(filesystem {small_disk}: [\d.]+ kB free\)",
                     errors[0]), errors[0]
    assert re.search(rf"; free at least [\d.]+ kB more on {small_disk} \(keeping fewer "
                     "checkpoints would not make room: only the newest intact checkpoint is "
                     r"left, and it stays\), then resume with `ddpkit train --config ", errors[0])


@contextlib.contextmanager
def _no_room(directory, how):
    """Every rank: no file over 8 kB ("fsize"), or all but 8 kB of the disk taken ("full")."""
    if how == "fsize":
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8000, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        return
    filler = os.path.join(directory, "filler")
    if comm.is_main():
        with open(filler, "wb") as f:
            f.write(bytes(shutil.disk_usage(directory).free - 8192))
    comm.barrier()
    try:
        yield
    finally:
        if comm.is_main():
            os.unlink(filler)


def own_loop_on_a_full_disk(directory, engine, how, async_save=False):
    """Every rank: one checkpoint, then a save with no room for it; what each rank saw."""
    rt = ddpkit.setup(engine=engine)
    torch.manual_seed(0)
    model = rt.wrap(nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    error = None
    with rt.checkpointer(directory, model=model, optimizer=optimizer, every_steps=1,
                         resume=None, async_save=async_save) as ckpt:
        ckpt.step()  # step 1: written
        ckpt.wait()
        with _no_room(directory, how):
            try:
                ckpt.step()
                ckpt.wait()  # async: the background write's failure, on every rank
            except DDPKitError as exc:
                error = f"{type(exc).__name__}: {exc}"
    return {"errors": comm.gather_object(error), "listing": sorted(os.listdir(directory))}


@pytest.mark.parametrize("engine,async_save", [("ddp", False), ("fsdp", False), ("ddp", True),
                                               ("fsdp", True)])
@pytest.mark.parametrize("how", ["fsize", "full"])
def test_a_save_with_no_room_in_a_users_own_loop_is_one_error_on_every_rank(tmp_path, engine,
                                                                            async_save, how,
                                                                            request):
    directory = (request.getfixturevalue("small_disk") if how == "full" else tmp_path) / "ckpt"
    out = ddpkit.launch(own_loop_on_a_full_disk, 2, str(directory), engine, how, async_save,
                        timeout=120)
    first = directory / "ckpt-000000001.pt"
    what = "checkpoint" if engine == "ddp" else "sharded checkpoint"
    suffix = "pt" if engine == "ddp" else "shards"
    reason = "file size limit exceeded" if how == "fsize" else "no space left on the device"
    for error in out["errors"]:  # every rank raised it: none is left waiting
        assert error.startswith(f"SaveError: {reason}: {what} "
                                f"{directory}/ckpt-000000002.{suffix} needs about "), error
        assert f"the newest intact checkpoint is {first}" in error
        assert error.endswith('rerun the script: resume="auto" (the default) continues from the '
                              'newest checkpoint')
    kept = ["ckpt-000000001.pt", "latest"] + (["ckpt-000000001.shards"] if engine == "fsdp" else [])
    assert out["listing"] == sorted(kept)  # nothing partial, no shards without a checkpoint
    assert find_latest(directory)[0] == first  # its shards complete too (FSDP)


def _torchs_error():
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")


def test_the_disk_full_error_is_found_under_torchs_own_error():
    with pytest.raises(RuntimeError) as wrapped:
        _torchs_error()
    assert disk_full(wrapped.value).errno == errno.ENOSPC
    assert disk_full(RuntimeError("other")) is None
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
    line = no_space(OSError(errno.EDQUOT, "Disk quota exceeded"), "checkpoint c/ckpt-2.pt",
                    ROOT, 2_500_000, None)
    assert line.startswith("disk quota exceeded: checkpoint c/ckpt-2.pt needs about 2.5 MB (")
    assert "there is no earlier checkpoint" in line and "\n" not in line


def test_sharded_writes_share_a_full_disk_so_that_every_rank_still_sees_it():
    # DCP pickles each rank's error to share it, which loses the OSError behind torch's own.
    with pytest.raises(RuntimeError) as wrapped:
        _torchs_error()
    assert disk_full(pickle.loads(pickle.dumps(wrapped.value))) is None
    with pytest.raises(OSError) as bare:
        with _bare_disk_full():
            _torchs_error()
    assert disk_full(pickle.loads(pickle.dumps(bare.value))).errno == errno.ENOSPC
    with pytest.raises(RuntimeError, match="^other$"):  # any other error passes unchanged
        with _bare_disk_full():
            raise RuntimeError("other")
