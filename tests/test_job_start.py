"""ddpkit.job.start: where `ddpkit train` runs a job, from Python as from the command line; the
worker entry; and the main job after a bare `pip install ddpkit` (no optional package)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ddpkit.checkpoint.files import find_latest
from ddpkit.base.errors import ConfigError
from ddpkit.job.config import TrainConfig
from ddpkit.job.start import WORKER, inside_a_launcher, job_nproc, plan, start
from ddpkit.launchers.torchrun import RunConfig

import forkrun
from test_cli import ddpkit


@pytest.mark.parametrize("nproc,launch,inside,engine,where", [
    (1, {}, False, "ddp", "here"),
    (2, {}, False, "ddp", "torchrun"),
    (1, {"nnodes": 2}, False, "ddp", "torchrun"),
    (1, {"max_restarts": 1}, False, "ddp", "torchrun"),   # restarts need torchrun's agent
    (2, {}, True, "ddp", "here"),                          # already a worker of torchrun
    (2, {}, False, "horovod", "horovodrun"),
    (1, {}, False, "horovod", "here"),
])
def test_plan_picks_where_the_job_runs(nproc, launch, inside, engine, where):
    cfg = TrainConfig(nproc=nproc, engine=engine)
    assert plan(cfg, RunConfig(WORKER, **launch), inside) == where


OUTER = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": "29999"}


@pytest.mark.parametrize("environ,parent,inside", [
    ({}, ["-bash"], False),
    ({**OUTER, "TORCHELASTIC_RUN_ID": "oldjob"}, ["-bash"], False),          # left in a shell
    ({**OUTER, "TORCHELASTIC_RUN_ID": "oldjob"}, ["timeout", "9", "ddpkit", "train"], False),
    (OUTER, ["-bash"], False),                                               # nothing vouches
    ({**OUTER, "TORCHELASTIC_RUN_ID": "j"}, ["/venv/bin/python", "/venv/bin/torchrun"], True),
    ({**OUTER, "TORCHELASTIC_RUN_ID": "j"}, ["python", "-m", "torch.distributed.run"], True),
    ({**OUTER, "TORCHELASTIC_RUN_ID": "j", "DDPKIT_LAUNCHER_PID": str(os.getppid())},
     ["python", "-m", "ddpkit", "run"], True),                               # ddpkit run's agent
    ({**OUTER, "OMPI_COMM_WORLD_SIZE": "4"}, ["mpirun"], True),
    ({**OUTER, "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, ["/bin/sh"], True),   # a pod's ranks
])
def test_a_worker_of_a_launcher_or_an_outer_jobs_variables(environ, parent, inside, capsys):
    assert inside_a_launcher(environ, parent=parent) == inside
    note = capsys.readouterr().err
    assert ("note: ignoring RANK=1 WORLD_SIZE=4" in note) == (bool(environ) and not inside)


@pytest.mark.slow
@pytest.mark.parametrize("run_id", ["oldjob", None])
def test_train_in_a_shell_with_an_outer_jobs_variables_launches_its_own(tmp_path, run_id):
    # once a 10-minute hang that ignored Ctrl-C (with TORCHELASTIC_RUN_ID), else a 60 s wait
    env = {**OUTER, **({"TORCHELASTIC_RUN_ID": run_id} if run_id else {})}
    res = forkrun.ddpkit("train", "--epochs", "1", "--output", str(tmp_path), env=env,
                         clean=False, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count("note: ignoring RANK=1 WORLD_SIZE=4") == 1
    assert "final: top-1" in res.stdout


def test_start_from_python_trains_in_this_process(tmp_path, capsys):
    out = tmp_path / "run"
    assert start(TrainConfig(nproc=1, epochs=1, max_steps=3, output=str(out),
                             progress=False)) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["max_steps"] == 3 and saved["nproc"] == 1
    assert "resolved config (saved to" in capsys.readouterr().out
    assert list((out / "checkpoints").glob("ckpt-*.pt"))  # stopped by max_steps: work kept


@pytest.mark.slow
def test_the_worker_entry_has_help_and_one_line_errors(tmp_path):
    def worker(*args):
        return forkrun.python("-m", WORKER, *args, timeout=60)

    ok = worker("--help")
    assert ok.returncode == 0 and ok.stdout.startswith("usage: python -m ddpkit.job.train")
    none = worker()
    assert none.returncode == 2 and none.stderr.count("\n") == 1
    missing = worker(str(tmp_path / "nope.json"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: cannot read the job config") and \
        "Traceback" not in missing.stderr


@pytest.mark.slow
def test_the_main_job_runs_without_any_optional_package(tmp_path):
    # What `pip install ddpkit` alone gives: torch, tqdm, numpy. The optional packages are made
    # unimportable for the launcher and every worker (they inherit PYTHONPATH).
    blocked = tmp_path / "blocked"
    for name in ("sklearn", "yaml", "tensorboard", "torchmetrics", "matplotlib", "horovod"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked')\n")
    out = tmp_path / "run"
    res = ddpkit("train", "--epochs", "1", "--output", str(out), env={"PYTHONPATH": str(blocked)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "final: top-1" in res.stdout and "359 test samples" in res.stdout


# ----------------------------------------------------------------------------- --nproc auto

def test_job_nproc_auto_is_one_per_gpu_and_two_on_cpu(monkeypatch):
    assert job_nproc("auto", gpus=8) == 8 and job_nproc("auto", gpus=1) == 1
    assert job_nproc(3, gpus=8) == 3 and job_nproc("5", gpus=0) == 5
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert job_nproc("auto", gpus=0) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert job_nproc("auto", gpus=0) == 1
    with pytest.raises(ConfigError, match="positive integer or 'auto'"):
        job_nproc("two", gpus=0)


@pytest.mark.slow
def test_default_job_saves_the_resolved_process_count(tmp_path):
    # auto on this CPU machine: 2 processes; the run directory records the number, not 'auto'
    assert start(TrainConfig(nproc="auto", epochs=1, max_steps=2, output=str(tmp_path),
                             progress=False)) == 0
    assert json.loads((tmp_path / "config.json").read_text())["nproc"] == min(2, os.cpu_count())


def test_more_processes_than_gpus_under_nccl_is_refused_before_launch(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as exc:
        start(TrainConfig(nproc=2, output=str(tmp_path)))
    assert str(exc.value).startswith("2 processes on this node but only 1 CUDA device(s): NCCL "
                                     "needs one GPU per process; use --nproc 1 (or auto)")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.slow
def test_cuda_requested_on_a_machine_without_it_is_one_line(tmp_path):
    res = ddpkit("train", "--accelerator", "cuda", "--output", str(tmp_path))
    assert res.returncode != 0
    assert res.stderr.strip() == ("error: --accelerator cuda: no CUDA device is visible here; use "
                                  "--accelerator cpu (or auto), or check CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_compile_trains_on_cpu_and_checkpoints_clean_names(tmp_path):
    res = ddpkit("train", "--nproc", "1", "--compile", "--epochs", "1", "--max-steps", "3",
                 "--output", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    _path, ckpt = find_latest(tmp_path / "checkpoints")
    assert ckpt["progress"]["step"] == 3
    assert list(ckpt["model"])[:2] == ["conv1.weight", "bn1.weight"]


@pytest.mark.slow
def test_compile_without_a_compiler_is_one_line(tmp_path):
    res = ddpkit("train", "--nproc", "1", "--compile", "--output", str(tmp_path),
                 env={"PATH": str(tmp_path)})  # no g++ / clang++ on PATH
    assert res.returncode != 0
    assert res.stderr.strip() == ("error: --compile: torch.compile on CPU needs a C++ compiler "
                                  "(g++ or clang++) on PATH; drop --compile to train without it")


@pytest.mark.parametrize("content,said", [
    ("state_dict", "a plain state_dict: 2 tensors ('weight', 'bias')"),
    ("other", "a dict of 2 key(s): 'epoch', 'state'"),
])
def test_resuming_a_file_that_is_not_a_ddpkit_checkpoint_is_one_line(tmp_path, content, said):
    path = tmp_path / "weights.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict() if content == "state_dict"
               else {"epoch": 3, "state": {}}, path)
    out = tmp_path / "run"
    res = ddpkit("train", "--resume", str(path), "--output", str(out), timeout=60)
    assert res.returncode == 2
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "is not a checkpoint of ddpkit train" in errors[0], res.stderr
    assert said in errors[0] and "Traceback" not in res.stderr
    assert not out.exists()  # nothing written


@pytest.mark.slow
def test_a_new_seed_on_resume_is_refused_before_writing_and_other_changes_are_said(tmp_path):
    out = tmp_path / "run"
    assert ddpkit("train", "--nproc", "1", "--epochs", "1", "--max-steps", "3", "--output",
                  str(out)).returncode == 0
    before = (out / "config.json").read_text()
    res = ddpkit("train", "--nproc", "1", "--epochs", "1", "--seed", "5", "--resume", "auto",
                 "--output", str(out))
    assert res.returncode == 2 and "was written with --seed 0, but this run asks for --seed 5" \
        in res.stderr
    assert (out / "config.json").read_text() == before  # the run's own resume still works
    res = ddpkit("train", "--nproc", "1", "--epochs", "2", "--lr", "0.1", "--resume", "auto",
                 "--output", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "with changes from the run that wrote it: epochs 1 -> 2, lr 0.05 -> 0.1, max_steps " \
           "3 -> None" in res.stderr


@pytest.mark.slow
def test_ctrl_c_in_the_first_seconds_of_train_is_one_line(tmp_path):
    # while torch loads, the flags are read, the workers start: once a 10-30 line traceback
    import signal
    import time
    for i, after in enumerate((0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5)):
        proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--output",
                                 str(tmp_path / str(i))], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(after)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
        lines = [l for l in err.splitlines() if l.strip()]
        assert proc.returncode == 130 and len(lines) == 1, (after, err[-2000:])
        assert "interrupted" in lines[0] and "Traceback" not in err


INTERRUPTED_WHILE_LOADING = """
import os, runpy, signal, sys, time
class Interrupt:   # Ctrl-C arrives while MODULE is being imported
    done = False
    def find_spec(self, name, path=None, target=None):
        if name == MODULE and not self.done:
            self.done = True
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                if SWALLOW:  # what torch's C extension does with an error while it loads numpy
                    pass
                else:
                    raise
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["ddpkit", "train", "--help"]
runpy.run_module("ddpkit", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module,swallow", [
    # the window a sweep once hit at 1.5 s (a CI-like run): `python -m ddpkit` importing
    # ddpkit.cli, after ddpkit itself loaded
    ("ddpkit.cli.bench", False),
    # while numpy loads: torch's C extension imports it and clears the error, so a Ctrl-C at
    # 0.5 s went on to train (a CI run), or left numpy half loaded for an ImportError later
    ("numpy.lib", False),
    # a Ctrl-C something swallows while the modules load is still an interrupt
    ("numpy", True),
])
def test_ctrl_c_while_the_commands_modules_load_is_one_line(module, swallow):
    script = f"MODULE, SWALLOW = {module!r}, {swallow}\n" + INTERRUPTED_WHILE_LOADING
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 130 and res.stderr.splitlines() == ["interrupted"], res.stderr


def test_a_worker_interrupted_before_setup_leaves_quietly(tmp_path):
    # the window the sweep above hits only by chance (a CI run once caught it): the launcher
    # forwards Ctrl-C while the worker's job modules load or its config is read, before setup()
    # installs the stop handler; the worker left a traceback under the launcher's one line.
    # Deterministic here: the config path is a FIFO, so the worker blocks reading it.
    import signal
    import time
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    env = dict(os.environ, DDPKIT_LAUNCHER_PID=str(os.getpid()))
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit.job.train", str(fifo)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until it blocks opening the FIFO
        try:
            with open(f"/proc/{proc.pid}/wchan") as f:
                if f.read().strip() == "wait_for_partner":  # open() of a FIFO, no writer
                    break
        except OSError:
            pass
        time.sleep(0.05)
    try:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # blocked on the FIFO for good if the signal did not end it
        proc.wait()
    assert proc.returncode == 130 and err == "", err[-2000:]


SLOW_INTERPRETER_START = """
import os, signal, time
if os.environ.get("DDPKIT_LAUNCHER_PID"):  # a worker, not the launcher: starting slowly
    with open(os.path.join(os.path.dirname(__file__), "starting"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    deadline = time.monotonic() + 60
    while signal.SIGINT not in signal.sigpending() and time.monotonic() < deadline:
        time.sleep(0.02)  # a Ctrl-C held for later shows here; one delivered raises here
"""


def test_a_ctrl_c_while_the_workers_interpreters_start_is_one_line(tmp_path):
    # A CI run under load: `ddpkit train` interrupted 3 s in, as its workers' interpreters were
    # starting (importing runpy for -m): each printed "Could not import runpy module" and a
    # traceback under the launcher's line. Deterministic here: the workers' sitecustomize (site
    # runs before runpy) waits until both started, the Ctrl-C comes, and it returns once the
    # signal is pending (held); a signal delivered at once raises KeyboardInterrupt in it.
    import signal
    import time
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_INTERPRETER_START)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("DDPKIT_LAUNCHER_PID", None)
    # fresh interpreters (--start-method spawn): forked workers run no sitecustomize and start
    # no interpreter; their window before setup() is the FIFO test's above
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--nproc", "2",
                             "--start-method", "spawn", "--output", str(tmp_path / "run")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            starting = site / "starting"
            if starting.exists() and len(starting.read_text().split()) == 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("ddpkit run: interrupted (SIGINT); every worker stopped"), err


def test_a_users_script_starts_with_ctrl_c_as_python_gives_it(tmp_path):
    # the hold above is for ddpkit's own workers: a user's script may never import ddpkit, and
    # a SIGINT blocked there would be lost (the agent would wait 30 s, then kill it)
    script = tmp_path / "mask.py"
    script.write_text("import signal\nprint('blocked:', sorted(signal.pthread_sigmask("
                      "signal.SIG_BLOCK, [])))\n")
    res = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc", "1", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "blocked: []" in res.stdout, res.stdout + res.stderr


INTERRUPTED_WHILE_STARTING = """
import os, runpy, signal, sys
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh
pids, script = sys.argv[1:3]
class Popen(sh.Popen):   # Ctrl-C arrives after the agent started one worker of two
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with open(pids, "a") as f:
            f.write(f"{self.pid}\\n")
        os.kill(os.getpid(), signal.SIGINT)
sh.Popen = Popen
sys.argv = ["ddpkit", "run", "--nproc", "2", "--start-method", "spawn", script]
runpy.run_module("ddpkit", run_name="__main__", alter_sys=True)
"""


INTERRUPTED_WHILE_FORKING = """
import multiprocessing.context as context, os, runpy, signal, sys
pids, script = sys.argv[1:3]
start = context.ForkServerProcess.start
def started(self):   # Ctrl-C arrives after the agent forked one worker of two
    start(self)
    with open(pids, "a") as f:
        f.write(f"{self.pid}\\n")
    os.kill(os.getpid(), signal.SIGINT)
context.ForkServerProcess.start = started
sys.argv = ["ddpkit", "run", "--nproc", "2", script]
runpy.run_module("ddpkit", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("how", ["spawn", "forkserver"])
def test_ctrl_c_while_the_agent_starts_the_workers_stops_those_it_started(tmp_path, how):
    # a CI run: Ctrl-C at 1.5 s printed the one line, then the output stayed open 120 s. The
    # agent's handler interrupts start_processes before the agent records the workers, so its
    # shutdown closed none; the one started ran on in its own session, holding the pipes.
    # (torchrun's Popen with --start-method spawn; the default's forked workers likewise)
    pids, script = tmp_path / "pids", tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(300)\n")
    code = INTERRUPTED_WHILE_STARTING if how == "spawn" else INTERRUPTED_WHILE_FORKING
    proc = subprocess.Popen([sys.executable, "-c", code, str(pids), str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        for pid in (pids.read_text().split() if pids.exists() else ()):
            try:
                os.killpg(int(pid), 9)   # a worker the launcher left behind
            except OSError:
                pass
    started = pids.read_text().split()
    assert len(started) == 1, started
    assert proc.returncode == 130 and err.splitlines() == [
        "ddpkit run: interrupted (SIGINT); every worker stopped"], err[-2000:]
    assert _dead(started[0]), "the started worker still runs"


def _dead(pid):
    """Gone, or a zombie: a forked worker's parent (the fork server, also ended) leaves its
    reaping to init, which may come a moment later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.slow
def test_an_epoch_resumed_mid_way_reports_all_of_it(tmp_path):
    # once: the resumed epoch's loss and sample count covered only the steps after the resume
    common = ["--nproc", "2", "--data", "synthetic", "--synthetic-samples", "512",
              "--batch-size", "32", "--epochs", "2", "--ckpt-every-steps", "4", "--no-progress"]

    def epochs(out):
        with open(out / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        return [(r["epoch"], r["train/loss"], r["train/samples"]) for r in rows
                if "train/samples" in r and "stopped_at_step" not in r]

    assert ddpkit("train", *common, "--output", str(tmp_path / "whole")).returncode == 0
    cut = tmp_path / "cut"
    assert ddpkit("train", *common, "--max-steps", "10", "--output", str(cut)).returncode == 0
    res = ddpkit("train", *common, "--resume", "auto", "--output", str(cut))
    assert res.returncode == 0 and "mid-epoch" in res.stdout, res.stderr[-2000:]
    whole = epochs(tmp_path / "whole")
    assert [e[2] for e in whole] == [512, 512]
    assert epochs(cut) == whole  # the same losses, bitwise, and every sample counted
