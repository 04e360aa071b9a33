"""The ddpkit command end to end, in subprocesses: run, train, slurm, and bad input."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import forkrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def ddpkit(*args, cwd=ROOT, timeout=240, env=None):
    """`python -m ddpkit ARGS`, forked (tests/forkrun.py); the CompletedProcess."""
    return forkrun.ddpkit(*args, cwd=cwd, timeout=timeout, env=env)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith(("error:", "[rank"))]


# ----------------------------------------------------------------------------- ddpkit run

def test_run_example_on_two_processes(tmp_path):
    out = tmp_path / "model.pt"
    res = ddpkit("run", "--nproc", "2", "examples/train_ddpkit.py", "--epochs", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("test accuracy") == 1, "only rank 0 prints"
    accuracy = float(res.stdout.split("test accuracy ")[1].split("%")[0])
    assert accuracy > 80 and "on 820 samples" in res.stdout
    assert out.exists()


def test_failing_rank_exits_nonzero_quickly_with_one_error(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import ddpkit\nrt = ddpkit.setup()\n"
                      "if rt.rank == 1:\n    raise RuntimeError('rank one exploded')\n"
                      "rt.barrier()\n")
    # quickly: rank 0, in its barrier, is ended by rank 1's failure, not by the collective
    # timeout (10 min by default): that wait would outlast the 120 s given here
    res = ddpkit("run", "--nproc", "2", str(script), timeout=120)
    assert res.returncode != 0
    assert "timed out" not in res.stderr, res.stderr
    assert res.stderr.count("RuntimeError: rank one exploded") == 1, res.stderr
    assert "Traceback" in res.stderr and res.stderr.count("Traceback") == 1
    assert "ddpkit run: rank 1 failed" in res.stderr


def test_config_error_in_workers_is_one_line_from_rank_0(tmp_path):
    script = tmp_path / "bad_batch.py"
    script.write_text("import torch, ddpkit\nrt = ddpkit.setup()\n"
                      "rt.loader(torch.utils.data.TensorDataset(torch.zeros(8)), batch_size=3)\n")
    res = ddpkit("run", "--nproc", "2", str(script))
    assert res.returncode == 2
    assert error_lines(res.stderr) == [
        "error: batch_size=3 cannot be split evenly over 2 processes; use batch_size=2 or 4, "
        "or give per_rank_batch= a rank's own batch"], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args,message", [
    (["run", "--nproc", "0", "examples/train_ddpkit.py"], "--nproc must be >= 1"),
    (["run", "--nproc", "-2", "examples/train_ddpkit.py"], "--nproc must be >= 1"),
    (["run", "--nproc", "two", "examples/train_ddpkit.py"], "positive integer or 'auto'"),
    (["run", "--nproc", "2", "no/such/script.py"], "script 'no/such/script.py' does not exist"),
    (["run", "--nproc", "2"], "a script is required: ddpkit run [--nproc N] SCRIPT [ARGS...]"),
    (["run", "--nproc", "2", "examples"], "script 'examples' is a directory"),
    (["run", "--nproc", "2", "tests/data/syntax_error.py"],
     "tests/data/syntax_error.py:3: SyntaxError: '(' was never closed"),
    (["run", "--nnodes", "2", "examples/train_ddpkit.py"], "--rdzv-endpoint"),
    (["run", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "examples/train_ddpkit.py"],
     "--node-rank 2 is impossible"),
    (["train", "--model", "resnet99"], "unknown model 'resnet99'; valid models: "),
    (["train", "--data", "mnist"], "unknown dataset 'mnist'; valid datasets: "),
    (["train", "--data", "cifar10", "--data-dir", "/no/such/dir"], "/no/such/dir"),
    (["train", "--batch-size", "64", "--accum-steps", "5"], "--accum-steps 5 cannot split"),
    (["train", "--batch-size", "63"],
     "--batch-size 63 cannot be split evenly over 2 processes; use --batch-size 62 or 64"),
    (["train", "--master-port", "70000"], "--master-port must be between 1 and 65535, got 70000"),
    (["train", "--timeout-s", "0"], "--timeout-s must be > 0, got 0.0"),
    (["train", "--eval-batch-size", "0"], "--eval-batch-size must be >= 1, got 0"),
    (["train", "--ckpt-keep", "0"], "--ckpt-keep must be >= 1, got 0"),
    (["train", "--comm-hook", "powersgd", "--powersgd-start-iter", "1"],
     "--powersgd-start-iter must be >= 2, got 1"),
    (["run", "--master-port", "0", "examples/train_ddpkit.py"],
     "--master-port must be between 1 and 65535"),
    (["run", "--nnodes", "0", "examples/train_ddpkit.py"], "--nnodes must be >= 1, got 0"),
    (["run", "--nnodes", "3:2", "examples/train_ddpkit.py"],
     "MIN (3) is larger than MAX (2); write --nnodes 2:3"),
    (["run", "--nnodes", "two", "examples/train_ddpkit.py"], "MIN:MAX such as 2:4, got 'two'"),
    (["run", "--nnodes", "2:3", "--master-addr", "127.0.0.1", "examples/train_ddpkit.py"],
     "--nnodes 2:3 (elastic) needs a c10d rendezvous: pass --rdzv-endpoint"),
    (["run", "--nnodes", "2:3", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-last-call", "0",
      "examples/train_ddpkit.py"], "--rdzv-last-call must be > 0"),
    (["run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-last-call", "5",
      "examples/train_ddpkit.py"], "--rdzv-last-call only applies to an elastic job"),
    (["train", "--nnodes", "2:3", "--rdzv-endpoint", "127.0.0.1:29400", "--nproc", "1",
      "--batch-size", "32"], "on 3 nodes --batch-size 32 cannot be split evenly over 3 "
                             "processes; use a --batch-size every node count splits: 30 or 36"),
    (["train", "--data", "synthetic", "--synthetic-samples", "1", "--batch-size", "4"],
     "use --synthetic-samples 2 or more, or --nproc 1"),
    (["train", "--precision", "fp16"], "fp16 needs a CUDA device"),
    (["train", "--sync-bn"], "--sync-bn needs GPUs"),
    (["train", "--engine", "dp", "--nproc", "2"], "use --nproc 1"),
    (["train", "--nproc", "0"], "--nproc (nproc) must be a positive integer or 'auto', got '0'"),
    (["train", "--accelerator", "cuda"], "--accelerator cuda: no CUDA device is visible"),
    (["run", "--backend", "glo", "examples/train_ddpkit.py"], "--backend 'glo' is not a backend"),
    (["plan", "--params", "-5", "--compute-ms", "10"], "--params must be a parameter count >= 1"),
    (["plan", "--params", "nan", "--compute-ms", "10"], "--params must be a parameter count >= 1"),
    (["plan", "--params", "1e6", "--compute-ms", "inf"], "--compute-ms must be a number > 0"),
    (["verify", "--backend", "glo", "examples/train_ddpkit.py"], "--backend 'glo' is not a backend"),
    (["slurm", "--time", "soon", "train.py"], 'bad --time \'soon\': Slurm takes "minutes", '),
    (["run", "--nproc", "100000", "examples/train_ddpkit.py"],
     "--nproc 100000 cannot fit in this node's memory: 100000 workers need at least "),
    (["train", "--nproc", "100000", "--batch-size", "100000"],
     "--nproc 100000 cannot fit in this node's memory"),
])
def test_bad_input_gives_one_error_line(args, message, capsys, monkeypatch):
    # In this process (the command's own code from its entry on, without a fresh interpreter and
    # its torch import for each of the 38); the next test takes a few through a real process.
    from ddpkit.cli import status_of
    monkeypatch.chdir(ROOT)
    code = status_of(list(args))
    out, err = capsys.readouterr()
    assert_refused_in_one_line(code, out, err, message)


@pytest.mark.parametrize("args,message", [
    (["run", "--nproc", "two", "examples/train_ddpkit.py"], "positive integer or 'auto'"),
    (["run", "--nproc", "2", "tests/data/syntax_error.py"],
     "tests/data/syntax_error.py:3: SyntaxError: '(' was never closed"),
    (["train", "--batch-size", "63"],
     "--batch-size 63 cannot be split evenly over 2 processes; use --batch-size 62 or 64"),
    (["plan", "--params", "nan", "--compute-ms", "10"], "--params must be a parameter count >= 1"),
])
def test_bad_input_through_the_command_is_one_line_and_exit_2(args, message):
    res = ddpkit(*args, timeout=60)
    assert_refused_in_one_line(res.returncode, res.stdout, res.stderr, message)


def assert_refused_in_one_line(code, out, err, message):
    assert code == 2, (out, err)
    lines = error_lines(err)
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    assert "resolved config" not in out, "refused before anything is written or started"


def test_busy_master_port_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = ddpkit("run", "--nproc", "2", "--master-port", str(port), "examples/train_ddpkit.py")
    assert res.returncode == 2
    assert f"master port {port} on 127.0.0.1 is already in use" in res.stderr


def test_run_backend_reaches_the_scripts_setup(tmp_path):
    script = tmp_path / "backend.py"
    script.write_text("import os, ddpkit\nrt = ddpkit.setup()\n"  # one write: ranks share stdout
                      "os.write(1, f'rank {rt.rank} {rt.backend} {os.environ[\"DDPKIT_BACKEND\"]}\\n'"
                      ".encode())\n")
    res = ddpkit("run", "--nproc", "2", "--backend", "gloo", str(script))
    assert res.returncode == 0, res.stderr
    assert sorted(l for l in res.stdout.splitlines() if l.startswith("rank")) == \
        ["rank 0 gloo gloo", "rank 1 gloo gloo"]
    res = ddpkit("run", "--nproc", "2", "--backend", "nccl", str(script))  # on CPU: refused
    assert res.returncode == 2 and "backend 'nccl' needs CUDA devices" in res.stderr


def test_two_jobs_on_one_machine_at_once(tmp_path):
    # torchrun's static store port (29500) would let only one of them start
    script = tmp_path / "meet.py"
    script.write_text("import time, torch, torch.distributed as dist, ddpkit\n"
                      "rt = ddpkit.setup()\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                      "time.sleep(3)\nif rt.rank == 0:\n    print('sum', t.item())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    jobs = [subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    for job in jobs:
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err[-2000:]
        assert "sum 2.0" in out


def test_run_timeout_names_a_stuck_rank_that_soon(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text("import time, torch, torch.distributed as dist, ddpkit\n"
                      "rt = ddpkit.setup()\nif rt.rank == 1:\n    time.sleep(120)\n"
                      "dist.all_reduce(torch.ones(1))\n")
    res = ddpkit("run", "--nproc", "2", "--timeout", "5", str(script), timeout=100)
    assert res.returncode == 1
    assert "collective all_reduce timed out after 5 s" in res.stderr
    assert "rank 1 did not arrive" in res.stderr, res.stderr[-2000:]
    assert ddpkit("run", "--timeout", "0", str(script)).returncode == 2


def test_a_ranks_config_error_is_not_restarted(tmp_path):
    script = tmp_path / "backend.py"
    script.write_text("import ddpkit\nddpkit.setup(backend='nccl')\n")
    res = ddpkit("run", "--nproc", "2", "--max-restarts", "2", str(script))
    assert res.returncode == 2
    assert error_lines(res.stderr) == ["error: backend 'nccl' needs CUDA devices but this process "
                                       "runs on CPU; use --backend gloo (or leave it unset)"]
    assert "restarting" not in res.stderr and "ddpkit run: rank" not in res.stderr


def test_unknown_backend_in_worker_is_one_line(tmp_path):
    script = tmp_path / "backend.py"
    script.write_text("import ddpkit\nddpkit.setup(backend='nccl')\n")
    res = ddpkit("run", "--nproc", "2", str(script))
    assert res.returncode == 2
    assert error_lines(res.stderr) == ["error: backend 'nccl' needs CUDA devices but this process "
                                       "runs on CPU; use --backend gloo (or leave it unset)"]


def test_slurm_renders_sbatch():
    res = ddpkit("slurm", "--nodes", "2", "--gpus-per-node", "4", "train.py", "--epochs", "3")
    assert res.returncode == 0
    assert "#SBATCH --nodes=2" in res.stdout and "--gres=gpu:4" in res.stdout
    assert "srun ddpkit run --nnodes" in res.stdout and "train.py --epochs 3" in res.stdout


# ----------------------------------------------------------------------------- ddpkit train

@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`ddpkit train` with no flags but the output directory: the README's main job."""
    out = tmp_path_factory.mktemp("demo") / "run"
    res = ddpkit("train", "--output", str(out), timeout=600)
    return res, out


def test_default_train_reaches_the_accuracy_bar(default_run):
    res, out = default_run
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["final"]["eval/top1"] >= 95.0
    assert results["final"]["eval/count"] == 359, "exact evaluation counts every test sample once"
    assert results["epochs"] == 12


def test_default_train_logs_once_and_writes_run_dir(default_run):
    res, out = default_run
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in res.stdout
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in res.stdout
    assert res.stdout.count("epoch 1/12 ") == 1 and res.stdout.count("Total params") == 1
    assert json.loads((out / "config.json").read_text())["nproc"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if "eval/top1" in r]
    assert len(epochs) == 12 and all(r["train/samples"] == 1438 for r in epochs)
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*.pt"))[-1].startswith("ckpt-")


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('epochs = 1\nnproc = 1\nmodel = "small_cnn"\nbatch_size = 32\n')
    res = ddpkit("train", "--config", str(cfg), "--batch-size", "48", "--output", str(tmp_path / "r"),
                 "--precision", "bf16", "--channels-last", "--accum-steps", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (saved["epochs"], saved["batch_size"], saved["precision"]) == (1, 48, "bf16")
    assert saved["channels_last"] and saved["accum_steps"] == 2


def test_config_file_unknown_key_and_type(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: 2\nlearning_rate: 0.1\n")
    res = ddpkit("train", "--config", str(bad), timeout=60)
    assert res.returncode == 2 and "unknown config key 'learning_rate'" in res.stderr
    bad.write_text("epochs: two\n")
    res = ddpkit("train", "--config", str(bad), timeout=60)
    assert res.returncode == 2 and "'epochs' must be of type int" in res.stderr


def test_nonfinite_loss_stops_with_the_step(tmp_path):
    res = ddpkit("train", "--nproc", "1", "--epochs", "1", "--lr", "1e12", "--scheduler", "none",
                 "--optimizer", "sgd", "--momentum", "0", "--output", str(tmp_path / "nan"))
    assert res.returncode == 2
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and "loss is nan at step" in lines[0] and "--skip-nonfinite" in lines[0]


# ----------------------------------------------------------------------------- resume via the CLI

def test_train_resume_auto_and_bad_checkpoints(tmp_path):
    out = tmp_path / "run"
    common = ["train", "--epochs", "2", "--output", str(out), "--ckpt-every-steps", "5"]
    res = ddpkit(*common, "--resume", "auto", "--max-steps", "12")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "starting fresh" in res.stdout
    res = ddpkit(*common, "--resume", "auto")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stdout and "ckpt-000000012.pt" in res.stdout
    assert json.loads((out / "results.json").read_text())["steps"] == 2 * 23

    # evaluated alone on 3 processes, over which the training batch (64) does not split: the
    # run's final evaluation again, and nothing in the run directory written
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    res = ddpkit("train", "--eval-only", "--nproc", "3", "--resume", "auto", "--output", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    final = json.loads((out / "results.json").read_text())["final"]
    lines = [line for line in res.stdout.splitlines() if line.startswith("eval of ")]
    assert len(lines) == 1 and "ckpt-000000046.pt (step 46) on 3 processes: " in lines[0], res.stdout
    assert f"top1 {final['eval/top1']:.2f}%" in lines[0] and f"({final['eval/count']} targets)" in lines[0]
    loss = float(lines[0].split("loss ")[1].split()[0])
    assert loss == pytest.approx(final["eval/loss"], abs=2e-4)  # summed in another order
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before

    # a checkpoint from another model: both models named, one line, before anything is written
    res = ddpkit("train", "--nproc", "1", "--epochs", "1", "--model", "resnet18",
                 "--output", str(tmp_path / "other"), "--resume", str(out / "checkpoints"), timeout=120)
    lines = error_lines(res.stderr)
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "written with --model small_cnn" in lines[0] and "--model resnet18" in lines[0]
    assert not (tmp_path / "other" / "config.json").exists()

    # a truncated checkpoint given explicitly
    latest = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
    broken = tmp_path / "broken.pt"
    broken.write_bytes(latest.read_bytes()[:1000])
    res = ddpkit("train", "--nproc", "1", "--output", str(tmp_path / "b"), "--resume", str(broken),
                 timeout=120)
    lines = error_lines(res.stderr)
    assert res.returncode == 2 and len(lines) == 1 and "broken.pt" in lines[0], res.stderr[-2000:]

    res = ddpkit("train", "--resume", str(tmp_path / "nope.pt"), timeout=60)
    assert res.returncode == 2 and "does not exist" in error_lines(res.stderr)[0]


@pytest.mark.slow
def test_train_with_async_checkpoints_resumes_to_the_same_run_as_synchronous_ones(tmp_path):
    common = ["train", "--epochs", "2", "--ckpt-every-steps", "5", "--resume", "auto"]
    whole = ddpkit(*common, "--output", str(tmp_path / "sync"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "async"
    first = ddpkit(*common, "--output", str(out), "--ckpt-async", "--max-steps", "12")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "asynchronous checkpoints: a " in first.stdout and "snapshot" in first.stdout
    again = ddpkit(*common, "--output", str(out), "--ckpt-async")
    assert again.returncode == 0 and "ckpt-000000012.pt" in again.stdout, again.stderr[-2000:]
    ends = [torch.load(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
            for run in (tmp_path / "sync", out)]
    assert ends[0]["progress"] == ends[1]["progress"]
    for name, value in ends[0]["model"].items():
        assert torch.equal(value, ends[1]["model"][name]), name


@pytest.mark.slow
def test_train_chooses_its_checkpoint_interval_and_bad_cadence_flags_are_one_line(tmp_path):
    res = ddpkit("train", "--nproc", "1", "--epochs", "1", "--ckpt-every-steps", "auto",
                 "--ckpt-mtbf-hours", "0.5", "--output", str(tmp_path / "auto"))
    assert res.returncode == 0, res.stderr[-2000:]
    said = [line for line in res.stdout.splitlines() if "chosen from a save that blocks" in line]
    assert len(said) == 1 and "and a failure every 0.5 h (Young/Daly" in said[0], res.stdout
    assert (tmp_path / "auto" / "checkpoints" / "ckpt-000000020.pt").is_file()
    for flags, said in ((["--ckpt-every-steps", "soon"], "--ckpt-every-steps (ckpt_every_steps) "
                         "must be an integer >= 0 (0: off) or 'auto', got 'soon'"),
                        (["--ckpt-mtbf-hours", "0"], "--ckpt-mtbf-hours must be > 0, got 0.0")):
        res = ddpkit("train", *flags, "--output", str(tmp_path / "bad"), timeout=60)
        lines = error_lines(res.stderr)
        assert res.returncode == 2 and len(lines) == 1 and said in lines[0], res.stderr[-2000:]
    assert not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------- issue 22

def test_wrapping_twice_is_one_line_from_rank_0(tmp_path):
    script = tmp_path / "wrap_twice.py"
    script.write_text("import torch, ddpkit\nrt = ddpkit.setup()\nnet = torch.nn.Linear(2, 2)\n"
                      "model = rt.wrap(net)\nmodel = rt.wrap(model)\n")
    res = ddpkit("run", "--nproc", "2", str(script))
    assert res.returncode == 2, res.stderr
    assert error_lines(res.stderr) == [
        "error: rt.wrap was already called on this Linear (it returned a "
        "DistributedDataParallel): wrap a model once and keep using what rt.wrap returned; for "
        "a second copy (a teacher, an EMA) wrap copy.deepcopy(rt.unwrap(model))"], res.stderr
    assert "Traceback" not in res.stderr


def test_max_steps_inside_an_epoch_and_skipped_steps_end_like_any_run(tmp_path):
    """Rows 8 and 11: a run stopped by --max-steps mid-epoch evaluates, prints its final line
    and writes results.json; skipped non-finite steps are counted there and in the epoch line."""
    out = tmp_path / "run"
    res = ddpkit("train", "--nproc", "2", "--max-steps", "30", "--skip-nonfinite", "--lr", "1e4",
                 "--output", str(out))
    assert res.returncode == 0, res.stderr
    epochs = [line for line in res.stdout.splitlines() if line.startswith("epoch ")]
    assert "(max_steps reached at step 30; epoch 2 not finished)" in epochs[-1]
    assert "steps (NaN/inf gradients)" in epochs[-1], epochs
    assert "final: top-1" in res.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 30 and results["final"]["epoch"] == 2
    assert "eval/top1" in results["final"]
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_epoch = [h["train/skipped_steps"] for h in history if "train/skipped_steps" in h]
    assert results["skipped_steps"] == sum(per_epoch) > 0


def test_a_copied_run_resumes_from_itself_and_another_model_is_refused_before_writing(tmp_path):
    """Rows 9 and 10: the copy of a run directory resumes from and writes to itself (the
    original untouched); resuming with another --model is one line and config.json is kept."""
    original, copy = tmp_path / "run", tmp_path / "copy"
    res = ddpkit("train", "--nproc", "2", "--max-steps", "30", "--output", str(original))
    assert res.returncode == 0, res.stderr
    import shutil
    shutil.copytree(original, copy)
    before = {p.name: p.read_bytes() for p in original.rglob("*") if p.is_file()}
    res = ddpkit("train", "--config", str(copy / "config.json"), "--resume", "auto",
                 "--max-steps", "40")
    assert res.returncode == 0, res.stderr
    assert f"resumed from {copy}/checkpoints/ckpt-000000030.pt" in res.stdout
    assert (copy / "checkpoints" / "ckpt-000000040.pt").is_file()
    assert {p.name: p.read_bytes() for p in original.rglob("*") if p.is_file()} == before
    config = (copy / "config.json").read_bytes()
    res = ddpkit("train", "--config", str(copy / "config.json"), "--resume", "auto",
                 "--model", "resnet18")
    assert res.returncode == 2
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and "was written with --model small_cnn, but this run asks for " \
        "--model resnet18" in lines[0], res.stderr
    assert (copy / "config.json").read_bytes() == config
