"""Bad input, third round, row 1: `ddpkit train --output DIR` into a directory that holds an
earlier run (its results.json, its checkpoints) is refused in one line unless it resumes that run
or asks for --overwrite, which deletes the earlier run's own files (and nothing else) first."""
import json
import os

import pytest

from ddpkit.cli import status_of
from ddpkit.base.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["train", "--nproc", "1", "--epochs", "1", "--max-steps", "1", "--data", "synthetic",
        "--synthetic-samples", "64", "--batch-size", "32", "--no-progress"]


def _finished_run(out):
    """What a finished run leaves (the files' contents are stand-ins)."""
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "ckpt-000000046.pt").write_bytes(b"old weights")
    (out / "checkpoints" / "latest").write_text("ckpt-000000046.pt\n")
    (out / "config.json").write_text('{"epochs": 2}\n')
    (out / "metrics.jsonl").write_text('{"step": 46}\n')
    (out / "results.json").write_text('{"steps": 46}\n')
    (out / "notes.txt").write_text("the user's own\n")
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def claim_output(*args, **kwargs):
    from ddpkit.job.previous import claim_output as claim

    return claim(*args, **kwargs)


def _contents(out):
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_a_finished_runs_directory_is_refused_in_one_line_and_kept(tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    before = _finished_run(out)
    assert status_of([*FAST, "--output", str(out)]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: --output {out} holds a finished run (results.json, 1 checkpoint, the newest "
        "ckpt-000000046.pt): continue it with --resume auto, give this run another --output, "
        "or add --overwrite to delete that run's files first"], captured.err
    assert "Traceback" not in captured.err and "resolved config" not in captured.out
    assert _contents(out) == before  # the old results, metrics and checkpoints kept


def test_an_unfinished_runs_checkpoints_are_not_mixed_with_a_fresh_run(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    (out / "results.json").unlink()
    with pytest.raises(ConfigError, match=r"holds an unfinished run \(1 checkpoint, the newest "
                                          r"ckpt-000000046.pt\): continue it with --resume auto"):
        claim_output(str(out), resume=None, overwrite=False)


def test_overwrite_deletes_the_earlier_runs_own_files_and_nothing_else(tmp_path, capsys):
    out = tmp_path / "run"
    _finished_run(out)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_text("x")
    claim_output(str(out), resume=None, overwrite=True)
    assert sorted(str(p) for p in _contents(out)) == ["notes.txt"]
    assert capsys.readouterr().err.splitlines() == [
        f"note: --overwrite: deleted the earlier run in {out} (checkpoints/, config.json, "
        "metrics.jsonl, results.json, tensorboard/)"]


@pytest.mark.parametrize("resume", ["auto", "runs/x/checkpoints"])
def test_a_resumed_or_empty_directory_is_taken_as_it_is(tmp_path, resume, capsys):
    out = tmp_path / "run"
    before = _finished_run(out)
    claim_output(str(out), resume=resume, overwrite=False)   # continuing it: its files stay
    claim_output(str(tmp_path / "new"), resume=None, overwrite=False)
    (tmp_path / "config-only").mkdir()   # a run that failed before it saved anything
    (tmp_path / "config-only" / "config.json").write_text("{}\n")
    claim_output(str(tmp_path / "config-only"), resume=None, overwrite=False)
    assert _contents(out) == before and capsys.readouterr().err == ""


def test_overwrite_with_resume_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    before = _finished_run(out)
    assert status_of([*FAST, "--output", str(out), "--overwrite", "--resume", "auto"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --overwrite starts the run afresh and --resume continues it: "
                      "give one of them"]
    assert _contents(out) == before


def test_results_json_read_back_after_overwrite_is_the_new_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    _finished_run(out)
    assert status_of([*FAST, "--output", str(out), "--overwrite"]) == 0, capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["steps"] == 1
    assert (out / "notes.txt").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 1
    assert '"step": 46' not in (out / "metrics.jsonl").read_text()
