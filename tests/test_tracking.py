"""rt.log and its trackers (ddpkit.training.tracking): what a resumed run's history holds.

The rules, in one process with a simulated crash: the JSONL file keeps what the checkpoint
covers and the resumed run writes the rest once; append-only trackers (MLflow, W&B) get a record
only once a checkpoint covering it is on disk, and a resume sends what the crashed attempt had
not. The real runs (kill -9 under `ddpkit run`, a real MLflow server) are further down.
"""
import json

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.training import tracking as tr


class Sink:
    """An append-only tracker that keeps what it was sent (a stand-in for MLflow's server,
    which outlives the processes: one list across attempts)."""

    rewrites = False

    def __init__(self, got):
        self.got = got
        self.sent_through = -1

    def write(self, records):
        self.got.extend((pos, step, dict(m)) for pos, step, _, m in records)
        self.sent_through = max([self.sent_through] + [r[0] for r in records])

    def close(self):
        pass


class WithSink(tr.Tracking):
    """A Tracking whose one tracker is the stand-in (as rank 0 opens it)."""

    def __init__(self, log_dir, got, **kwargs):
        super().__init__(log_dir, ["stand-in"], **kwargs)
        self.got = got

    def _tracker(self, name, jsonl):
        return Sink(self.got)


def attempt(log_dir, got, steps, save_every, state=None, crash_after=None, asynchronous=False,
            landed=False):
    """One attempt of a loop that logs after each step's save; returns the checkpoint state
    on disk when it ended (crashed or not)."""
    pos = [0]
    t = WithSink(log_dir, got, position=lambda: pos[0], key="k1")
    t.attach()
    on_disk, in_flight = state, None
    if state is not None:
        t.load_state_dict(state)
        pos[0] = state["pos"]
    for step in steps:
        pos[0] = step
        if step % save_every == 0:  # ckpt.step(): a save
            if asynchronous:  # the one before is on disk now; this one is written meanwhile
                if in_flight is not None:
                    on_disk = in_flight
                    t.saved()
                in_flight = t.state_dict()
            else:
                on_disk = t.state_dict()
                t.saved()
        t.log({"loss": step / 10}, step=step)
        if step == crash_after:  # kill -9: nothing more runs; a write in flight may land
            return (in_flight or on_disk) if landed else on_disk
    if in_flight is not None:
        on_disk = in_flight
        t.saved()
    t.loop_ended()
    t.close()
    return on_disk


def history(log_dir):
    with open(log_dir / "metrics.jsonl") as f:
        return [(r["pos"], r["step"], r["loss"]) for r in map(json.loads, f)]


@pytest.mark.parametrize("asynchronous,landed", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("crash_after", [7, 9, 10])  # between saves, at a save, after one
def test_a_crash_and_resume_leave_the_history_of_an_uninterrupted_run(tmp_path, crash_after,
                                                                      asynchronous, landed):
    """landed: an asynchronous save was on disk before the crash, but the crashed attempt never
    learnt it (its records were not sent): the resumed run sends them."""
    whole, whole_got = tmp_path / "whole", []
    attempt(whole, whole_got, range(1, 16), 3, asynchronous=asynchronous)
    cut, got = tmp_path / "cut", []
    state = attempt(cut, got, range(1, 16), 3, crash_after=crash_after,
                    asynchronous=asynchronous, landed=landed)
    # the crashed attempt sent only what the checkpoint on disk covers
    assert got and max(pos for pos, _, _ in got) <= state["pos"] < crash_after + 1
    attempt(cut, got, range(state["pos"] + 1, 16), 3, state=state, asynchronous=asynchronous)
    assert history(cut) == history(whole)
    assert got == whole_got == [(s, s, {"loss": s / 10}) for s in range(1, 16)]


def test_without_a_checkpointer_every_record_goes_out_at_once(tmp_path):
    got = []
    t = WithSink(tmp_path, got, key="k")
    t.log({"loss": 1.0}, step=5)
    assert got == [(0, 5, {"loss": 1.0})]


def test_a_crash_drops_what_no_checkpoint_covers_and_a_clean_end_sends_it(tmp_path):
    got = []
    t = WithSink(tmp_path, got, key="k", position=lambda: 4)
    t.attach()
    t.log({"loss": 1.0})
    t.close(final=False)
    assert got == []
    t2 = WithSink(tmp_path / "b", got, key="k", position=lambda: 4)
    t2.attach()
    t2.log({"loss": 1.0})
    t2.close(final=True)
    assert got == [(4, 4, {"loss": 1.0})]


def test_values_are_numbers_and_one_element_tensors(tmp_path):
    import torch
    t = tr.Tracking(tmp_path, key="k", position=lambda: 2)
    t.log({"loss": torch.tensor(0.5), "lr": 0.1, "note": "warm"})
    t.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: record[k] for k in ("step", "pos", "loss", "lr", "note")} == {
        "step": 2, "pos": 2, "loss": 0.5, "lr": 0.1, "note": "warm"}
    with pytest.raises(ConfigError, match="takes a dict"):
        t.log(0.5)


def test_an_unknown_tracker_or_a_missing_package_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="unknown tracker 'comet'; choose from tensorboard, "
                                          "mlflow, wandb"):
        tr.tracker_names("tensorboard,comet")
    monkeypatch.setitem(tr.TRACKERS, "mlflow", ("ddpkit_no_such_module", "mlflow"))
    with pytest.raises(ConfigError, match=r"pip install 'ddpkit\[mlflow\]'"):
        tr.tracker_names(["mlflow"])
    assert tr.tracker_names(" TensorBoard, tensorboard ") == ["tensorboard"]


def test_a_resumed_run_whose_trackers_opened_before_the_resume_is_refused(tmp_path):
    t = tr.Tracking(tmp_path, key="new")
    t.log({"loss": 1.0})
    with pytest.raises(ConfigError, match="create the checkpointer first"):
        t.load_state_dict({"key": "old", "pos": 3})


def test_the_loader_takes_a_rank_s_own_batch_as_accelerate_users_write_it():
    """Coming from Accelerate, whose batch_size is each process's (issue 58's TypeError)."""
    import torch
    from torch.utils.data import TensorDataset

    from ddpkit.env.detect import ClusterEnv
    from ddpkit.training.runtime import Runtime

    rt = Runtime(ClusterEnv(), torch.device("cpu"), None)
    data = TensorDataset(torch.arange(40.0))
    loader = rt.loader(data, per_rank_batch=16, shuffle=False)
    assert loader.batch.micro_batch == 16 and loader.batch.global_batch == 16
    assert [len(b[0]) for b in loader] == [16, 16, 8]
    with pytest.raises(ConfigError, match="needs batch_size= .* or per_rank_batch="):
        rt.loader(data)
    with pytest.raises(ConfigError, match="both given: give one"):
        rt.loader(data, batch_size=32, per_rank_batch=16)


# ---------------------------------------------------------------------------- real runs
# A script's own loop (tests/own_loop_script.py: evaluation mid-training, DataLoader workers)
# logs each step's loss and each evaluation after the step's save, under `ddpkit run`, to the
# JSONL file, TensorBoard and a real MLflow server; kill -9 of a rank, restart, resume: every
# tracker's history equals the uninterrupted run's, point for point.

import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

import forkrun  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = {  # name -> own_loop_script flags (2 ranks, 3 epochs of 6 steps, saves every 3 steps)
    "whole": [],
    "rank0-killed-between-saves": ["--kill-rank", "0", "--kill-step", "8"],
    "rank1-killed-after-a-save": ["--kill-rank", "1", "--kill-step", "9"],
    "rank0-killed-async": ["--async-save", "--kill-rank", "0", "--kill-step", "10"],
    "fit-whole": ["--fit"],  # fit logs through rt.log's path (setup(log_to=...))
    "fit-rank0-killed": ["--fit", "--kill-rank", "0", "--kill-step", "8"],
}
TIMES = ("train/epoch_s", "train/samples_per_s", "train/step_ms", "time")  # differ run to run


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """A real MLflow tracking server (SQLite store) on a free local port, stopped after."""
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install -e '.[dev]'")
    d = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    log = open(d / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{d}/mlflow.db", "--default-artifact-root",
         str(d / "artifacts"), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail("the MLflow server did not start:\n"
                        + (d / "server.log").read_text()[-3000:])
        time.sleep(0.5)
    yield uri
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mlflow_uri):
    done = {}
    for name, flags in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        res = forkrun.ddpkit(
            "run", "--nproc", "2", "--max-restarts", "1", os.path.join(HERE, "own_loop_script.py"),
            "--out", str(out), "--epochs", "3", "--workers", "2", "--eval-every", "4",
            "--log-to", "tensorboard,mlflow", *flags, env={"MLFLOW_TRACKING_URI": mlflow_uri},
            timeout=300)
        assert res.returncode == 0, f"{name}:\n{res.stderr[-3000:]}"
        done[name] = (out, res)
    return done


def _jsonl(out):
    with open(os.path.join(out, "log", "metrics.jsonl")) as f:
        return [{k: v for k, v in r.items() if k not in TIMES} for r in map(json.loads, f)]


def _tensorboard(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(out, "log", "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
            if tag not in TIMES}


def _mlflow(out, uri):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    with open(os.path.join(out, "log", ".ddpkit-sent.json")) as f:
        key = json.load(f)["key"]
    exp = client.get_experiment_by_name("own-loop")
    found = client.search_runs([exp.experiment_id], f"tags.`ddpkit.run_key` = '{key}'")
    assert len(found) == 1, f"{len(found)} MLflow runs for one ddpkit run"
    run = found[0]
    keys = set(run.data.metrics) - set(TIMES)
    return run.info.status, {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in keys}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if "whole" not in n and "fit" not in n])
def test_after_kill_9_and_resume_every_tracker_holds_the_uninterrupted_history(runs, name,
                                                                               mlflow_uri):
    whole, (out, res) = runs["whole"][0], runs[name]
    assert "resumed from" in res.stdout + res.stderr  # it did crash and resume
    expected = _jsonl(whole)
    steps = [r["step"] for r in expected if "train/loss" in r]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 12
    assert [r["step"] for r in expected if "eval/loss" in r] == list(range(4, len(steps) + 1, 4))
    assert _jsonl(out) == expected
    assert _tensorboard(out) == _tensorboard(whole)
    status, history = _mlflow(out, mlflow_uri)
    assert history == _mlflow(whole, mlflow_uri)[1]
    assert [s for s, _ in history["train/loss"]] == steps, "a step lost or repeated"
    assert status == "FINISHED"


@pytest.mark.slow
def test_fit_logs_through_the_same_path_and_its_history_survives_kill_9(runs, mlflow_uri):
    whole, (out, res) = runs["fit-whole"][0], runs["fit-rank0-killed"]
    assert "resumed from" in res.stdout + res.stderr
    expected = _jsonl(whole)
    assert [r["step"] for r in expected if "epoch" in r] == [12, 24, 36]  # fit's epoch records
    assert _jsonl(out) == expected
    assert _tensorboard(out) == _tensorboard(whole)
    assert _mlflow(out, mlflow_uri)[1] == _mlflow(whole, mlflow_uri)[1]


# W&B offline (no network here): the run's history is read back from its .wandb files, the
# crashed attempt's and the resumed one's (one W&B run id, the ddpkit run's key).
WANDB_RUNS = {"whole": [], "killed": ["--kill-rank", "0", "--kill-step", "8"]}


@pytest.fixture(scope="module")
def wandb_runs(tmp_path_factory):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install -e '.[dev]'")
    home = tmp_path_factory.mktemp("wandb-home")
    env = {"WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"), "WANDB_SILENT": "true"}
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        pytest.skip("WANDB_API_KEY or WANDB_MODE is set here: this test proves the offline "
                    "default")
    done = {}
    for name, flags in WANDB_RUNS.items():
        out = tmp_path_factory.mktemp(f"wandb-{name}")
        res = forkrun.ddpkit(
            "run", "--nproc", "2", "--max-restarts", "1", os.path.join(HERE, "own_loop_script.py"),
            "--out", str(out), "--epochs", "2", "--eval-every", "4", "--log-to", "wandb", *flags,
            env=env, timeout=300)
        assert res.returncode == 0, f"{name}:\n{res.stderr[-3000:]}"
        done[name] = (out, res)
    return done


def _wandb_history(out):
    """{step: {key: value}} from every offline run file under OUT/log/wandb, in file order."""
    import glob

    from wandb.proto import wandb_internal_pb2

    files = sorted(glob.glob(os.path.join(out, "log", "wandb", "offline-run-*", "run-*.wandb")))
    ids, points = set(), []
    for path in files:
        ids.add(os.path.basename(path)[4:-6])
        for data in _leveldb_log(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            points.append((int(items["_step"]), {k: v for k, v in items.items()
                                                 if not k.startswith("_")}))
    return files, ids, points


def _leveldb_log(path, block=32768):
    """The records of a .wandb file (wandb >= 0.2x reads them in Go only): a 7-byte header
    (":W&B", magic, version), then LevelDB's log format: 32 KiB blocks of chunks, each
    crc32 (4 bytes), length (2), type (1: whole, 2: first, 3: middle, 4: last)."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header: zeros
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break  # preallocated zeros: the end of what was written
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            yield pending
            pending = b""


@pytest.mark.slow
def test_a_w_and_b_offline_run_is_continued_and_its_history_is_the_uninterrupted_one(wandb_runs):
    whole, (out, res) = wandb_runs["whole"][0], wandb_runs["killed"]
    assert "resumed from" in res.stdout + res.stderr
    files, ids, points = _wandb_history(out)
    assert len(files) == 2 and len(ids) == 1, (files, ids)  # two attempts, one W&B run
    expected = _wandb_history(whole)[2]
    steps = [s for s, _ in expected]
    assert steps == sorted(set(steps)) and len(steps) > 12  # one point a step, no gap
    merged = {}
    for step, values in points:  # W&B keeps a step's first value; a second must be the same
        assert merged.setdefault(step, values) == values, f"step {step} differs"
    assert merged == {s: v for s, v in expected}, "a step lost or different"


def test_mlflow_without_a_tracking_uri_writes_a_sqlite_store_in_the_log_dir(tmp_path,
                                                                           monkeypatch):
    # MLflow 3 refuses its old file store (mlruns/): the default must be one it accepts
    pytest.importorskip("mlflow", reason="mlflow is not installed (the dev extra has it)")
    from mlflow.tracking import MlflowClient
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = tr.Tracking(tmp_path, ["mlflow"], key="k", project="default-store")
    t.log({"loss": 0.5}, step=1)
    t.log({"loss": 0.25}, step=2)
    t.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("default-store")
    (run,) = client.search_runs([exp.experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (1, 0.5), (2, 0.25)]
    assert run.info.status == "FINISHED"
