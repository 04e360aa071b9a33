"""Checkpoint I/O: atomic saves, pruning, safe and verified loads, resume discovery, mismatches."""
import errno
import os
import pickle
import random
import warnings

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint import files as ck
from ddpkit.checkpoint.files import (check_compatible, check_optimizer_compatible, checkpoint_metadata,
                               find_latest, list_checkpoints, load_checkpoint, resolve_resume,
                               save_checkpoint)
from ddpkit.checkpoint.write import SaveError
from ddpkit.base.errors import ConfigError, DDPKitError

import ckptfns


def state_for(step: int) -> dict:
    """A checkpoint-shaped state whose big tensor dominates the file (so its middle is data)."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.zeros(3)}, "step": step}


def names(directory) -> list:
    return sorted(p.name for p in directory.iterdir())


def test_round_trip_of_everything_weights_only_accepts(tmp_path):
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "nested": {"a": [1, 2.5, "three", None, True], "b": {"c": (4, torch.ones(2))}},
             "step": 7, "lr": 0.1, "name": "run", "rng": random.getstate(),
             "meta": checkpoint_metadata(), "half": torch.arange(4, dtype=torch.bfloat16)}
    path = save_checkpoint(state, tmp_path / "ck", 7)
    assert path == tmp_path / "ck" / "ckpt-000000007.pt"
    loaded = load_checkpoint(path)
    assert loaded["nested"]["a"] == [1, 2.5, "three", None, True]
    assert loaded["nested"]["b"]["c"][0] == 4
    assert torch.equal(loaded["nested"]["b"]["c"][1], torch.ones(2))
    assert (loaded["step"], loaded["lr"], loaded["name"]) == (7, 0.1, "run")
    assert loaded["half"].dtype == torch.bfloat16
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["model"][key], value), key
    opt.load_state_dict(loaded["optimizer"])     # restorable as-is
    random.setstate((loaded["rng"][0], tuple(loaded["rng"][1]), loaded["rng"][2]))
    assert loaded["meta"] == {"ddpkit": ddpkit.__version__, "torch": str(torch.__version__),
                              "format": 1}


def test_keep_prunes_older_and_latest_points_at_the_newest(tmp_path):
    for step in range(1, 6):
        save_checkpoint(state_for(step), tmp_path, step, keep=2)
    assert names(tmp_path) == ["ckpt-000000004.pt", "ckpt-000000005.pt", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000000005.pt"
    assert [p.name for p in list_checkpoints(tmp_path)] == names(tmp_path)[:2]
    path, state = find_latest(tmp_path)
    assert path.name == "ckpt-000000005.pt" and state["step"] == 5


def test_pointer_wins_and_a_higher_step_from_an_abandoned_run_is_not_pruned(tmp_path):
    save_checkpoint(state_for(10), tmp_path, 10, keep=1)
    save_checkpoint(state_for(2), tmp_path, 2, keep=1)   # e.g. restarted from an older checkpoint
    assert names(tmp_path) == ["ckpt-000000002.pt", "ckpt-000000010.pt", "latest"]
    assert find_latest(tmp_path)[1]["step"] == 2
    save_checkpoint(state_for(3), tmp_path, 3, keep=1)
    assert names(tmp_path) == ["ckpt-000000003.pt", "ckpt-000000010.pt", "latest"]


def test_a_save_stopped_before_its_pointer_moved_is_the_one_resumed_and_named(tmp_path,
                                                                             monkeypatch):
    # issue 35.7: SIGTERM during a slow save; the workers were killed after ckpt-6's rename but
    # before the pointer moved: the stop line named ckpt-6, the resume silently took ckpt-5
    from ddpkit.job.config import TrainConfig
    from ddpkit.job.start import resume_hint
    directory = tmp_path / "checkpoints"
    save_checkpoint(state_for(5), directory, 5)
    real = ck._point_to
    monkeypatch.setattr(ck, "_point_to", lambda final: (_ for _ in ()).throw(SystemExit(143)))
    with pytest.raises(SystemExit):   # stands for the SIGKILL between rename and pointer
        ck._save_on_main(state_for(6), directory, 6, 3)
    monkeypatch.setattr(ck, "_point_to", real)
    assert (directory / "latest").read_text().strip() == "ckpt-000000005.pt"
    assert [p.name for p in ck.resume_order(directory)][:2] == ["ckpt-000000006.pt",
                                                                 "ckpt-000000005.pt"]
    assert find_latest(directory)[1]["step"] == 6
    hint = resume_hint(TrainConfig(output=str(tmp_path)), "cfg.json")
    assert f"; last checkpoint {directory / 'ckpt-000000006.pt'}: continue with" in hint
    # killed earlier, while the temporary file was written: the stop line says it was not kept
    (directory / "ckpt-000000007.pt.tmp").write_bytes(b"PK\x03\x04 half")
    hint = resume_hint(TrainConfig(output=str(tmp_path)), "cfg.json")
    assert hint.startswith("; ckpt-000000007.pt was being written and is not kept; last "
                           f"checkpoint {directory / 'ckpt-000000006.pt'}")


def test_an_abandoned_timeline_stays_behind_the_pointer_whatever_the_order_of_writes(tmp_path):
    save_checkpoint(state_for(10), tmp_path, 10, keep=3)
    save_checkpoint(state_for(4), tmp_path, 4, keep=3)    # resumed from an older one, went on
    assert [p.name for p in ck.resume_order(tmp_path)] == ["ckpt-000000004.pt",
                                                           "ckpt-000000010.pt"]


def test_leftover_tmp_from_a_torn_write_is_ignored_then_cleaned(tmp_path):
    save_checkpoint(state_for(1), tmp_path, 1)
    (tmp_path / "ckpt-000000002.pt.tmp").write_bytes(b"PK\x03\x04 half a checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path, state = find_latest(tmp_path)
    assert path.name == "ckpt-000000001.pt" and state["step"] == 1
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000001.pt"]
    save_checkpoint(state_for(3), tmp_path, 3)
    assert "ckpt-000000002.pt.tmp" not in names(tmp_path)


def _damage_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _damage_middle(path):
    data = bytearray(path.read_bytes())
    rng = random.Random(0)
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(rng.randrange(256) for _ in range(64))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_middle],
                         ids=["truncated", "corrupted"])
def test_damaged_latest_warns_and_falls_back_to_the_previous(tmp_path, damage, capsys):
    for step in (1, 2):
        save_checkpoint(state_for(step), tmp_path, step)
    newest = tmp_path / "ckpt-000000002.pt"
    damage(newest)
    with pytest.raises(ConfigError, match=r"ckpt-000000002\.pt is unreadable \(truncated or "
                                          r"corrupted\): \S"):
        load_checkpoint(newest)
    path, state = find_latest(tmp_path)
    assert "ckpt-000000002.pt is unreadable" in capsys.readouterr().err
    assert path.name == "ckpt-000000001.pt"
    assert torch.equal(state["model"]["w"], state_for(1)["model"]["w"])


def test_silent_corruption_is_caught_even_though_torch_load_accepts_it(tmp_path):
    path = save_checkpoint(state_for(1), tmp_path, 1)
    _damage_middle(path)
    # torch.load alone returns wrong numbers here; the CRC check is what catches it.
    unchecked = torch.load(path, weights_only=True)
    assert not torch.equal(unchecked["model"]["w"], state_for(1)["model"]["w"])
    with pytest.raises(ConfigError, match="CRC"):
        load_checkpoint(path)


class _RunsCode:
    """Pickles as a call to ``fn(arg)``: exactly what a malicious checkpoint does."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


def _touch_cmd(marker) -> str:
    return f"open({str(marker)!r}, 'w').close()"


def test_malicious_pickles_are_refused_and_never_executed(tmp_path):
    marker, probe = tmp_path / "pwned", tmp_path / "probe"
    # Prove the payloads do run code when loaded unsafely (with a different marker).
    torch.save({"x": _RunsCode(exec, _touch_cmd(probe))}, tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert probe.exists()
    evil_zip = tmp_path / "evil.pt"
    torch.save({"x": _RunsCode(os.system, f"touch {marker}")}, evil_zip)
    evil_raw = tmp_path / "evil.pkl"
    evil_raw.write_bytes(pickle.dumps({"x": _RunsCode(exec, _touch_cmd(marker))}, protocol=2))
    for path in (evil_zip, evil_raw):
        with pytest.raises(ConfigError, match="refused: not a ddpkit checkpoint, not loaded"):
            load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_pickle_that_would_run_code_is_refused_not_called_unreadable(tmp_path, protocol, capsys):
    # pickle.dumps' default protocol (4, 5) framed: torch's safe loader stops at its first
    # opcode, before the global it names, so the refusal must not read as a torn file
    marker = tmp_path / "pwned"
    evil = tmp_path / "ckpt-000000003.pt"
    evil.write_bytes(pickle.dumps({"model": _RunsCode(os.system, f"touch {marker}")},
                                  protocol=protocol))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no raw torch warning about the protocol either
        with pytest.raises(ConfigError) as info:
            load_checkpoint(evil)
    message = str(info.value)
    assert "refused: not a ddpkit checkpoint, not loaded" in message, message
    assert "system" in message and "unreadable" not in message and "\n" not in message
    assert not marker.exists()
    _damage_truncate(evil)  # torn after the global: still refused, not "unreadable"
    with pytest.raises(ConfigError, match="refused: not a ddpkit checkpoint, not loaded"):
        load_checkpoint(evil)
    assert not marker.exists() and capsys.readouterr().err == ""


def test_a_skipped_checkpoint_is_one_warning_line_not_a_python_warning(tmp_path, capsys):
    for step in (1, 2):
        save_checkpoint(state_for(step), tmp_path, step)
    _damage_truncate(tmp_path / "ckpt-000000002.pt")
    (tmp_path / "latest").write_text("not a name")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a raw warning (file path, source line) would raise
        path, _ = find_latest(tmp_path)
    assert path.name == "ckpt-000000001.pt"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("warning: ") for line in err), err
    assert "latest: 'not a name' is not a checkpoint name" in err[0]
    assert "ckpt-000000002.pt is unreadable (truncated or corrupted)" in err[1]
    assert err[1].endswith("; skipping it") and ".py:" not in err[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_resume("auto", tmp_path, quiet=True)[0] == path  # the launcher's look
    assert capsys.readouterr().err == ""


def test_malicious_latest_is_skipped_by_find_latest(tmp_path, capsys):
    marker = tmp_path / "pwned"
    for step in (1, 2):
        save_checkpoint(state_for(step), tmp_path / "ck", step)
    # The file the latest pointer names is swapped for a malicious one.
    torch.save({"x": _RunsCode(exec, _touch_cmd(marker))}, tmp_path / "ck" / "ckpt-000000002.pt")
    path, _ = find_latest(tmp_path / "ck")
    assert "ckpt-000000002.pt refused: not a ddpkit checkpoint" in capsys.readouterr().err
    assert path.name == "ckpt-000000001.pt" and not marker.exists()


def test_missing_paths_and_resume_values(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(ConfigError, match=f"checkpoint {missing} does not exist"):
        load_checkpoint(missing)
    with pytest.raises(ConfigError, match="nope.pt does not exist"):
        resolve_resume(str(missing), tmp_path)
    assert resolve_resume(None, tmp_path) is None and resolve_resume("", tmp_path) is None
    assert resolve_resume("auto", tmp_path / "never-created") is None
    assert find_latest(tmp_path) is None                       # exists but empty
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        resolve_resume(str(tmp_path), tmp_path)
    save_checkpoint(state_for(4), tmp_path / "ck", 4)
    assert resolve_resume("auto", tmp_path / "ck")[1]["step"] == 4
    assert resolve_resume(str(tmp_path / "ck"), "unused")[1]["step"] == 4
    file_path, state = resolve_resume(str(tmp_path / "ck" / "ckpt-000000004.pt"), "unused")
    assert file_path.name == "ckpt-000000004.pt" and state["step"] == 4


def test_only_unreadable_checkpoints_is_an_error_not_a_fresh_start(tmp_path, capsys):
    path = save_checkpoint(state_for(1), tmp_path, 1)
    _damage_truncate(path)
    with pytest.raises(ConfigError, match="none of the 1 checkpoints"):
        find_latest(tmp_path)
    assert capsys.readouterr().err.startswith("warning: checkpoint ")
    with pytest.raises(ConfigError, match=r"could be loaded \(the newest: checkpoint .* is "
                                          r"unreadable \(truncated or corrupted\)"):
        find_latest(tmp_path, quiet=True)   # the launcher's look: the reason in its one line
    assert capsys.readouterr().err == ""


def test_model_mismatch_names_keys_and_shapes():
    saved = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 2)).state_dict()
    current = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2), nn.Linear(2, 2))
    with pytest.raises(ConfigError) as info:
        check_compatible(saved, current.state_dict())
    msg = str(info.value)
    assert "\n" not in msg and "different model" in msg
    assert "missing keys: 3.weight, 3.bias" in msg
    assert "0.weight: checkpoint (10, 4) vs model (3, 4)" in msg
    assert "2.weight: checkpoint (2, 10) vs model (2, 3)" in msg
    check_compatible(current.state_dict(), current)            # a module is accepted too
    wrapped = {f"module.{k}": v for k, v in current.state_dict().items()}
    with pytest.raises(ConfigError, match=r"unexpected keys: module\.0\.weight.*\(\+1 more\)"
                                          r".*'module\.' prefix"):
        check_compatible(wrapped, current)


def test_optimizer_mismatch():
    model = nn.Linear(4, 2)
    one_group = torch.optim.SGD(model.parameters(), lr=0.1)
    two_groups = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    check_optimizer_compatible(one_group.state_dict(), one_group)
    with pytest.raises(ConfigError, match="checkpoint optimizer has 2 param groups with 1, 1 "
                                          "params; this run's optimizer has 1 param group "
                                          "with 2 params"):
        check_optimizer_compatible(two_groups.state_dict(), one_group)


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["save", "replace"])
def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    save_checkpoint(state_for(1), tmp_path, 1)

    def partial_save(state, f, *args, **kwargs):
        f.write(b"PK\x03\x04 some bytes before the disk filled")
        _full_disk()
    monkeypatch.setattr(*((torch, "save", partial_save) if where == "save"
                          else (os, "replace", _full_disk)))
    with pytest.raises(SaveError, match=r"^no space left on the device: checkpoint "
                                        r"\S*ckpt-000000002\.pt needs about [\d.]+ kB \([^)]+ "
                                        r"free\); the partial write was removed and the newest "
                                        r"intact checkpoint is \S*ckpt-000000001\.pt; "):
        save_checkpoint(state_for(2), tmp_path, 2)
    monkeypatch.undo()
    assert names(tmp_path) == ["ckpt-000000001.pt", "latest"]   # no .tmp left behind
    assert load_checkpoint(tmp_path / "ckpt-000000001.pt")["step"] == 1
    assert find_latest(tmp_path)[0].name == "ckpt-000000001.pt"


def test_a_full_disk_at_the_pointer_keeps_the_checkpoint_just_written(tmp_path, monkeypatch):
    save_checkpoint(state_for(1), tmp_path, 1)
    write = ck.atomic_write

    def no_room_for_the_pointer(final, *args, **kwargs):
        if final.name == ck.LATEST:
            _full_disk()
        write(final, *args, **kwargs)
    monkeypatch.setattr(ck, "atomic_write", no_room_for_the_pointer)
    with pytest.raises(SaveError, match=r"newest intact checkpoint is \S*ckpt-000000002\.pt"):
        save_checkpoint(state_for(2), tmp_path, 2)
    monkeypatch.undo()
    # The stale pointer (to step 1) is gone, so a resume finds the newest file, step 2.
    assert names(tmp_path) == ["ckpt-000000001.pt", "ckpt-000000002.pt"]
    assert find_latest(tmp_path)[0].name == "ckpt-000000002.pt"


def test_state_the_safe_loader_would_refuse_is_rejected_at_save_time(tmp_path):
    np = pytest.importorskip("numpy")
    state = {"model": {"w": torch.ones(2)}, "rng": {"numpy": np.random.get_state()}}
    with pytest.raises(ConfigError, match=r"would refuse .*at state\['rng'\]\['numpy'\]\[1\] "
                                          r"\(ndarray\)"):
        save_checkpoint(state, tmp_path, 1)
    with pytest.raises(ConfigError, match=r"TorchVersion\) at state\['v'\] \(TorchVersion\)"):
        save_checkpoint({"v": torch.__version__}, tmp_path, 1)
    assert names(tmp_path) == []


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="keep must be an integer >= 1"):
        save_checkpoint({}, tmp_path, 1, keep=0)
    with pytest.raises(ConfigError, match="step must be an integer >= 0"):
        save_checkpoint({}, tmp_path, -1)
    with pytest.raises(ConfigError, match="must be a dict"):
        save_checkpoint([1, 2], tmp_path, 1)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(DDPKitError, match="no earlier checkpoint"):
        save_checkpoint({}, a_file, 1)
    with pytest.raises(ConfigError, match="is a file"):
        find_latest(a_file)


def test_pointer_to_elsewhere_is_ignored(tmp_path, capsys):
    save_checkpoint(state_for(1), tmp_path, 1)
    (tmp_path / ck.LATEST).write_text("../../etc/passwd\n")
    assert find_latest(tmp_path)[0].name == "ckpt-000000001.pt"
    assert "not a checkpoint name" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_one_writer_and_a_rank0_failure_reaches_both(tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("in the way")
    # rank 1 learns of rank 0's failure from rank 0 (out["errors"] below); were it left waiting
    # in a collective (10 min by default), launch's 120 s would raise TimeoutError instead
    out = ddpkit.launch(ckptfns.save_then_fail, 2, str(tmp_path / "ck"), str(not_a_directory),
                        timeout=120)
    second = str(tmp_path / "ck" / "ckpt-000000002.pt")
    assert out["returned"] == [[str(tmp_path / "ck" / "ckpt-000000001.pt"), second],
                               [None, None]]
    assert out["listing"] == [["ckpt-000000002.pt", "latest"]] * 2   # seen by both ranks
    assert out["saved_rank"] == 0
    rank0, rank1 = out["errors"]  # rank 1 raises rank 0's finding, which rank 0 alone prints
    assert rank0.startswith("DDPKitError: saving checkpoint") and "File exists" in rank0
    assert rank1 == rank0.replace("DDPKitError", "SaveError", 1)


def test_rng_state_survives_a_checkpoint_written_on_another_device(tmp_path):
    from ddpkit.base.seed import rng_state, set_rng_state

    torch.manual_seed(3)
    state = rng_state()
    assert "cuda_device" not in state  # no GPU in use: nothing of CUDA is read or created
    expected = torch.rand(3)
    # What a GPU run's checkpoint holds: its own device's CUDA state, and (older checkpoints)
    # every device's; on a machine without CUDA both are skipped and the CPU streams restored.
    state["cuda_device"] = torch.zeros(16, dtype=torch.uint8)
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    save_checkpoint({"rng": [state]}, tmp_path, step=1)
    loaded = load_checkpoint(find_latest(tmp_path)[0])
    torch.rand(5)
    set_rng_state(loaded["rng"][0])
    assert torch.equal(torch.rand(3), expected)


def test_random_bytes_are_not_a_checkpoint_not_code(tmp_path):
    # Issue 22 row 13: garbage must not read as if the file held code.
    path = tmp_path / "ckpt-000000001.pt"
    path.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    with pytest.raises(ConfigError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"{path} is not a checkpoint (unreadable: ")
    assert "refused" not in message and "\n" not in message
