"""Issue 55, row 9: a full disk's advice. "Keep fewer checkpoints" only where deleting older ones
would make room for the next; otherwise the space a checkpoint needs, how much is free, and on
which filesystem (a full disk with one checkpoint on it was told to keep fewer: that fails alike).
"""
import errno
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from ddpkit.checkpoint.files import save_checkpoint
from ddpkit.checkpoint.write import SaveError


def state(step: int, width: int = 64) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, width, generator=g)}, "step": step}


def full_save(monkeypatch, directory, new_state, step, keep, free) -> str:
    """Save with no room left (``free`` bytes free on the disk): the line the user gets."""
    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", no_room)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    with pytest.raises(SaveError) as err:
        save_checkpoint(new_state, directory, step, keep=keep)
    monkeypatch.undo()
    return str(err.value)


def test_with_one_checkpoint_on_disk_the_line_says_the_space_needed_and_where(tmp_path,
                                                                               monkeypatch):
    save_checkpoint(state(1), tmp_path, 1)   # keep=3, the default: one checkpoint on disk
    line = full_save(monkeypatch, tmp_path, state(2), 2, keep=3, free=1000)
    assert "keep fewer checkpoints: keep=" not in line, line   # it would fail the same way
    needed = re.search(r"needs about ([\d.]+) kB", line).group(1)
    mount = tmp_path.resolve()
    while not os.path.ismount(mount):
        mount = mount.parent
    assert f"needs about {needed} kB (filesystem {mount}: 1.0 kB free)" in line
    assert re.search(rf"free at least [\d.]+ kB more on {re.escape(str(mount))} \(keeping fewer "
                     r"checkpoints would not make room: only the newest intact checkpoint is "
                     r"left, and it stays\), then ", line), line
    assert "\n" not in line


def test_keeping_fewer_is_advised_only_when_the_older_checkpoints_it_deletes_make_room(
        tmp_path, monkeypatch):
    for step in (1, 2, 3):
        save_checkpoint(state(step), tmp_path, step, keep=4)
    one = (tmp_path / "ckpt-000000001.pt").stat().st_size
    # The same size again: deleting the oldest makes room, so keep=3 (the most that fits).
    line = full_save(monkeypatch, tmp_path, state(4), 4, keep=4, free=0)
    assert "(or keep fewer checkpoints: keep=3 / --ckpt-keep 3 holds 3 on disk while the next " \
           "is written, 4 now)" in line, line
    # Three times the size: only keep=2 (two deleted) makes room with 20 kB free...
    line = full_save(monkeypatch, tmp_path, state(4, width=192), 4, keep=4, free=20_000)
    assert "keep fewer checkpoints: keep=2 / --ckpt-keep 2" in line, line
    # ... and with nothing free not even that: the space to free, not advice that fails.
    line = full_save(monkeypatch, tmp_path, state(4, width=192), 4, keep=4, free=0)
    assert "keep fewer checkpoints: keep=" not in line, line
    assert f"deleting all but the newest would free only {2 * one / 1000:.1f} kB" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000001.pt", "ckpt-000000002.pt", "ckpt-000000003.pt", "latest"]
