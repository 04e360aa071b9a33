"""``ddpkit verify``: every planted bug in examples/broken/ is named, the README's example and a
BatchNorm model under --accum-steps pass, bad input is one line; the comparison and diagnosis
themselves on records made by hand (tolerance bands, non-determinism, unseeded runs)."""
import json
import os
import subprocess
import sys

import pytest

from ddpkit.data.loader import MicroStepSampler
from ddpkit.verify.compare import FLOOR, compare
from ddpkit.verify.records import RunRecord, Step, relative
from ddpkit.verify.runs import Diverged, run_script

import forkrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BROKEN = os.path.join(ROOT, "examples", "broken")


def _ddpkit(*args, cwd=ROOT, timeout=300):
    return forkrun.ddpkit(*args, cwd=cwd, timeout=timeout, clean=False)


# ---------------------------------------------------------------- planted bugs, end to end
# (file, steps, the cause verify must name). One and N processes are enough to name these
# causes; the repeated and the reordered 1-process runs are exercised by the CLI tests below.
PLANTED = [
    ("own_sampler.py", 3, "own-sampler"),
    ("shuffle_seed.py", 3, "loader-seed"),
    ("drop_last.py", 4, "loader-drop_last"),
    ("mean_of_means.py", 3, "mean-of-means"),
    ("model_randomness.py", 3, "model-randomness"),
    ("batchnorm.py", 3, "batchnorm"),
    ("accumulation_loss.py", 3, "accumulation-loss"),
    ("accumulation_step.py", 3, "accumulation-step"),
    ("unused_parameters.py", 3, "unused-parameters"),
    ("lr_scaled.py", 3, "learning-rate"),
    # issue 34: bugs that used to PASS, exit 2 or get another cause's name
    ("no_sampler.py", 3, "same-samples"),
    ("buffer_per_rank.py", 3, "ranks-differ"),
    ("collate_trims.py", 3, "data-path"),
    ("collate_empties.py", 3, "no-steps"),
    ("eval_rank0.py", 3, "evaluation"),
    ("metric_summed.py", 3, "metric-summed"),
    ("grads_twice.py", 3, "gradients-reduced-twice"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,steps,cause", PLANTED, ids=[p[0][:-3] for p in PLANTED])
def test_each_planted_bug_is_named(tmp_path, script, steps, cause):
    """The 1- and N-process runs train on to the script's first evaluation (at most 40 more
    steps), as verify runs them; every verdict carries its evidence."""
    path = os.path.join(BROKEN, script)
    try:
        one = run_script(path, [], 1, steps, str(tmp_path / "one"), timeout=240,
                         eval_within=40)
        many = run_script(path, [], 2, steps, str(tmp_path / "many"), timeout=240,
                          whole_epoch=False, eval_within=40)
    except Diverged as exc:
        assert exc.cause == cause, exc.why
        return
    verdict = compare(one, many, steps=steps, eval_within=40)
    assert not verdict.passed
    assert verdict.cause == cause, (verdict.cause, verdict.why, verdict.steps)
    assert verdict.why and "\n" not in verdict.why
    assert verdict.evidence and all(line and "\n" not in line for line in verdict.evidence)


@pytest.mark.slow
def test_an_unseeded_shuffle_is_named_by_the_samples_of_its_second_run(tmp_path):
    """setup(seed=0), but the script's own shuffle draws from a clock-seeded generator: the
    evidence is the samples the forward received in two runs of one process, not a GPU."""
    path = os.path.join(BROKEN, "shuffle_unseeded.py")
    one, again = (run_script(path, [], 1, 2, str(tmp_path / name), timeout=240)
                  for name in ("one", "again"))
    many = run_script(path, [], 2, 2, str(tmp_path / "many"), timeout=240, whole_epoch=False)
    verdict = compare(one, many, None, again)
    assert verdict.cause == "data-unseeded", (verdict.cause, verdict.why)
    assert "GPU" not in verdict.why and any("samples received different" in line
                                            for line in verdict.evidence), verdict.evidence


@pytest.mark.slow
def test_an_unseeded_script_is_named_by_its_second_run(tmp_path):
    proc = _ddpkit("verify", "--steps", "3", os.path.join(BROKEN, "unseeded.py"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL") and "[unseeded]" in last and "seed=0" in last, proc.stdout


# ---------------------------------------------------------------- passes
@pytest.mark.slow
def test_the_readme_example_passes_with_a_table_and_a_json_report(tmp_path):
    report = tmp_path / "verify.json"
    with open(os.path.join(ROOT, "docs", "verify.md")) as f:
        assert "ddpkit verify --steps 5 examples/train_ddpkit.py " in f.read()
    proc = _ddpkit("verify", "--steps", "5", "--json", str(report), "examples/train_ddpkit.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["step", "samples"]
    assert all(" equal " in line and line.endswith("ok") for line in lines[1:6])
    said = [line.strip() for line in lines[6:-1]]  # what the PASS compared, and did not
    assert said and all(line.startswith("compared: ") for line in said), said
    assert any("evaluation not compared" in line for line in said), said
    assert lines[-1].startswith("PASS: examples/train_ddpkit.py computes the same on 2 processes")
    data = json.loads(report.read_text())
    assert data["passed"] is True and data["nproc"] == 2 and len(data["steps"]) == 5
    assert all(s["samples_equal"] and s["relative"] <= s["tolerance"] for s in data["steps"])
    assert data["largest"] == max(s["relative"] for s in data["steps"])


@pytest.mark.slow
def test_a_real_shaped_script_passes_with_workers_augmentation_and_mid_training_evaluation():
    """tests/verify_script.py: BatchNorm, augmentation from the global generators in
    __getitem__, 2 DataLoader workers, 1000 samples, clipping imported before setup(), a
    GradScaler, OneCycleLR stepped per batch (its length from len(loader)), AdamW, evaluation
    every 2 steps. With --accum-steps 2 one
    process takes the 2 ranks' batches in turn: the same micro-batches, so BatchNorm agrees."""
    proc = _ddpkit("verify", "--steps", "3", "--accum-steps", "2", "tests/verify_script.py",
                   "--workers", "2", "--scaler")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "accumulating 2 micro-batches" in proc.stdout


@pytest.mark.slow
def test_augmentation_drawn_in_the_main_process_is_the_same_on_any_number_of_ranks(tmp_path):
    """num_workers=0: __getitem__ draws from the main process's generators; under verify every
    sample draws from its own seed, so 1 process and 2 augment each sample alike."""
    script, args = os.path.join(ROOT, "tests", "verify_script.py"), ["--workers", "0"]
    one = run_script(script, args, 1, 3, str(tmp_path / "one"), accum=2, timeout=240)
    many = run_script(script, args, 2, 3, str(tmp_path / "many"), whole_epoch=False,
                      timeout=240)
    verdict = compare(one, many)
    assert verdict.passed, verdict.steps
    # what verify changed is said, and what the script's own runs do: every rank's torch and
    # random generators stand alike (setup's seed) as __getitem__ draws from them
    assert any(n.startswith("the dataset draws from torch's generator and Python's random "
                            "generator: verify seeded each sample") for n in verdict.notes)
    assert any(n.startswith("warning: torch's, Python's random generator stands alike on all 2 "
                            "ranks") for n in verdict.notes), verdict.notes


@pytest.mark.slow
def test_noise_drawn_in_the_loop_is_named(tmp_path):
    script, args = os.path.join(ROOT, "tests", "verify_script.py"), ["--loop-noise"]
    one = run_script(script, args, 1, 2, str(tmp_path / "one"), accum=2, timeout=240)
    many = run_script(script, args, 2, 2, str(tmp_path / "many"), whole_epoch=False,
                      timeout=240)
    verdict = compare(one, many)
    assert verdict.cause == "loop-randomness", (verdict.cause, verdict.why)


def test_micro_step_sampler_takes_the_ranks_batches_in_turn():
    sampler = MicroStepSampler(range(10), micro_batch=2, num_replicas=2, rank=0, shuffle=False)
    # rank 0 of 2 takes 0 2 4 6 8, rank 1 takes 1 3 5 7 9; batches of 2, step by step
    assert list(sampler) == [0, 2, 1, 3, 4, 6, 5, 7, 8, 9]
    assert len(sampler) == 10 and sampler.num_samples == 5  # len(loader): one rank's batches


# ---------------------------------------------------------------- bad input: one line each
def _one_error_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.slow
def test_a_script_without_setup_is_one_line(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 1)\n"
                      "o = torch.optim.SGD(m.parameters(), 0.1)\n"
                      "m(torch.ones(1, 2)).sum().backward(); o.step()\n")
    assert "never called ddpkit.setup()" in _one_error_line(_ddpkit("verify", str(script)))


@pytest.mark.slow
def test_a_script_that_never_steps_is_one_line(tmp_path):
    script = tmp_path / "eval_only.py"
    script.write_text("import ddpkit\nrt = ddpkit.setup(seed=0)\nprint('evaluated')\n")
    assert "without an optimizer step" in _one_error_line(_ddpkit("verify", str(script)))


@pytest.mark.slow
def test_more_steps_than_an_epoch_is_one_line():
    line = _one_error_line(_ddpkit("verify", "--steps", "40", os.path.join(BROKEN,
                                                                          "batchnorm.py")))
    assert "goes past the script's first training epoch over its rt.loader: 16 optimizer steps" in line and "--steps 16" in line


@pytest.mark.slow
def test_an_optimizer_made_before_setup_under_accum_steps_is_one_line(tmp_path):
    script = tmp_path / "early.py"
    script.write_text(
        "import torch, ddpkit\nmodel = torch.nn.Linear(4, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "rt = ddpkit.setup(seed=0)\nmodel = rt.wrap(model)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))\n"
        "for x, y in rt.loader(data, 8):\n"
        "    (model(x) - y).pow(2).mean().backward(); opt.step(); opt.zero_grad()\n")
    line = _one_error_line(_ddpkit("verify", "--steps", "2", "--accum-steps", "2", str(script)))
    assert "create the optimizer after setup()" in line and "error: error" not in line


@pytest.mark.slow
def test_nproc_that_does_not_divide_the_global_batch_is_one_line():
    line = _one_error_line(_ddpkit("verify", "--nproc", "3", "--steps", "2",
                                   os.path.join(BROKEN, "batchnorm.py")))
    assert "--nproc 3 does not divide the script's global batch of 64" in line
    assert "--nproc 2 or 4" in line


@pytest.mark.parametrize("args,said", [
    ((), "a script is required"),
    (("examples",), "is a directory"),
    (("nope.py",), "does not exist"),
    (("--nproc", "1", "examples/train_ddpkit.py"), "--nproc must be >= 2"),
])
def test_bad_command_lines_are_one_line(args, said, capsys, monkeypatch):
    from ddpkit.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["verify", *args]) == 2          # refused before any process starts
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and said in err[0], err


# ---------------------------------------------------------------- comparison and diagnosis
def _run(losses, world=1, seeded=True, seeds=(0,), samples=None, **step):
    steps = [Step(i + 1, samples=list(samples or range(4)), loss=loss, grad_norm=1.0,
                  param_norm=2.0, param_sums=[loss], lr=0.1, backwards=[1] * world, **step)
             for i, loss in enumerate(losses)]
    return RunRecord(world_size=world, steps=steps, seeds=list(seeds), seeded=seeded,
                     loaders=[{"seed": 0, "shuffle": True, "drop_last": False}] * world,
                     models=[], foreign_loader=False, started=True)


def test_the_band_is_ten_times_the_reordered_spread_and_never_below_the_floor():
    one = _run([1.0, 1.0, 1.0])
    reordered = _run([1.0, 1.0 + 1e-5, 1.0])     # the reversed batches differ by 1e-5 at step 2
    many = _run([1.0 + 5e-7, 1.0 + 5e-5, 1.0 + 9e-5], world=2)
    verdict = compare(one, many, reordered, _run([1.0, 1.0, 1.0]))
    assert [s["tolerance"] for s in verdict.steps] == pytest.approx([FLOOR, 1e-4, 1e-4],
                                                                    rel=1e-3)
    assert verdict.passed and verdict.largest == pytest.approx(9e-5, rel=1e-2)
    worse = compare(one, _run([1.0, 1.0, 1.0 + 2e-4], world=2), reordered, _run([1.0] * 3))
    assert not worse.passed and worse.first_divergent == 3


def test_a_repeat_that_differs_is_non_determinism_even_when_n_agrees():
    one, again = _run([1.0, 2.0]), _run([1.0, 2.0 + 1e-3])
    one.device = again.device = "cuda"
    verdict = compare(one, _run([1.0, 2.0], world=2), _run([1.0, 2.0]), again)
    assert not verdict.passed and verdict.cause == "nondeterministic"
    assert "step 2" in verdict.why and "deterministic=True" in verdict.why
    # the same on a CPU is no GPU kernel: unexplained, with what was the same
    cpu = compare(_run([1.0, 2.0]), _run([1.0, 2.0], world=2), None, _run([1.0, 2.0 + 1e-3]))
    assert cpu.cause == "unexplained" and "GPU" not in cpu.why and "step 2" in cpu.why
    unseeded = compare(_run([1.0], seeded=False, seeds=(5,)), _run([1.0], world=2), None,
                       _run([1.5], seeded=False, seeds=(9,)))
    assert unseeded.cause == "unseeded"


def test_a_loss_scaled_by_the_world_and_other_samples_are_named():
    scaled = compare(_run([1.0]), _run([2.0], world=2))
    assert scaled.cause == "loss-scale"
    other = compare(_run([1.0]), _run([1.0], world=2, samples=[0, 1, 2, 9]))
    assert other.cause == "samples" and "1 of the 1-process step's 4 are missing" in other.why


def test_relative_difference():
    assert relative(0.0, 0.0) == 0.0
    assert relative(1.0, 1.0001) == pytest.approx(1e-4 / 1.0001)


def test_batches_drawn_by_the_script_itself_are_named_as_its_own_sampling():
    """nanoGPT's way (examples/gpt_ddpkit.py): random windows per rank, no rt.loader."""
    one, many = _run([1.0]), _run([1.1], world=2)
    for run in (one, many):
        run.steps[0].samples = None
    verdict = compare(one, many)
    assert verdict.cause == "own-sampler" and "nanoGPT" in verdict.why


def test_bf16_and_fp16_autocast_bound_the_band_by_their_roundings():
    from ddpkit.verify.compare import bounds

    assert bounds([]) == (FLOOR, 1e-3)
    assert bounds(["float16"]) == (2.0 ** -10, 8 * 2.0 ** -10)
    assert bounds(["bfloat16", "float16"]) == (2.0 ** -7, 8 * 2.0 ** -7)
    one, many = _run([1.0, 1.0]), _run([1.0 + 3e-3, 1.0 + 3e-2], world=2)
    reordered = _run([1.0, 1.0 + 2e-3])
    assert not compare(one, many, reordered).passed              # fp32: at most 1e-3
    one.autocast = many.autocast = ["bfloat16"]
    verdict = compare(one, many, reordered)
    assert [s["tolerance"] for s in verdict.steps] == pytest.approx([2.0 ** -7, 2e-2], rel=1e-2)
    assert verdict.first_divergent == 2 and verdict.ceiling == 8 * 2.0 ** -7


@pytest.mark.slow
def test_the_probe_sees_autocast(tmp_path):
    script = tmp_path / "bf16.py"
    script.write_text(
        "import torch, ddpkit\nrt = ddpkit.setup(seed=0)\n"
        "model = rt.wrap(torch.nn.Linear(4, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))\n"
        "for x, y in rt.loader(data, 8):\n"
        "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "        loss = (model(x).float() - y).pow(2).mean()\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n")
    record = run_script(str(script), [], 1, 2, str(tmp_path / "one"), timeout=120)
    assert record.autocast == ["bfloat16"] and len(record.steps) == 2


def test_loaders_built_differently_fail_even_where_the_steps_compared_agree():
    """On the epoch's samples, observed; settings that differ while every epoch hands out the
    same samples are no evidence (a FAIL [loader-global_batch] on a run whose every step of
    two epochs agreed, from the recorded batch alone)."""
    one, many = _run([1.0]), _run([1.0], world=2)
    many.loaders = [{"seed": 0, "shuffle": True, "drop_last": True}] * 2
    one.plans, many.plans = {0: (91, 12345)}, {0: (90, 2345)}
    verdict = compare(one, many)
    assert not verdict.passed and verdict.cause == "loader-drop_last"
    assert "epoch 0 hands out 91 samples on 1 process and 90 on 2" in verdict.why
    many.plans = {0: (91, 12345)}
    many.loaders = [{"seed": 0, "shuffle": True, "drop_last": False, "global_batch": 16}] * 2
    assert compare(one, many).passed


def test_the_json_report_is_strict_json_with_nan_losses():
    from ddpkit.verify.report import as_json

    verdict = compare(_run([float("nan")]), _run([1.0], world=2))
    assert not verdict.passed
    data = json.loads(as_json(verdict, 2, "s.py", []))   # NaN/inf written as null
    assert data["steps"][0]["loss_1"] is None and data["steps"][0]["relative"] is None


@pytest.mark.slow
def test_runs_side_by_side_keep_their_order_and_a_ctrl_c_ends_every_one(tmp_path):
    """verify's last three runs go at once: each outcome comes back in its place (an error as
    an error), and a Ctrl-C while they run ends every run's processes before it is raised."""
    import signal
    import time

    from ddpkit.verify.runs import _run, side_by_side

    def fails():
        raise ValueError("second")
    [(first, none), (nothing, error)] = side_by_side([lambda: "first", fails])
    assert (first, none, nothing, str(error)) == ("first", None, None, "second")

    sleeper = tmp_path / "sleeps.py"
    sleeper.write_text(f"import os, time\nopen(r'{tmp_path}/pid', 'w').write(str(os.getpid()))\n"
                       f"time.sleep(600)\nopen(r'{tmp_path}/slept', 'w').close()\n")

    def ctrl_c():  # the user's, once the first run is up: Python raises it in the main thread
        while not (tmp_path / "pid").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
    # Python's own Ctrl-C, whatever handler an earlier test left (torchrun's agent raises its
    # SignalException instead)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            side_by_side([lambda: _run([sys.executable, str(sleeper)], dict(os.environ), 600,
                                       "sleeps"), ctrl_c])
    finally:
        signal.signal(signal.SIGINT, previous)
    # killed with the interrupt, mid-sleep: gone, and it never wrote `slept` (a wait for the
    # run to end would take its 600 s, past pytest's timeout)
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)
    assert not (tmp_path / "slept").exists()


def test_a_run_that_hangs_is_stopped_with_its_ranks_and_one_line(tmp_path):
    """Past its timeout the run is killed, its ranks with it, and the wait ends: also a rank
    still importing when its launcher was killed (a loaded machine) stops at setup instead
    of sleeping on with the run's output open."""
    from ddpkit.base.errors import ConfigError

    script = tmp_path / "hangs.py"
    script.write_text("import os\n"  # before the imports: a rank starting late is seen too
                      f"open(r'{tmp_path}/pid' + os.environ['RANK'], 'w').write(str(os.getpid()))\n"
                      "import time, ddpkit\nrt = ddpkit.setup(seed=0)\ntime.sleep(600)\n")
    with pytest.raises(ConfigError, match="ran past 8 s without recording its steps"):
        run_script(str(script), [], 2, 1, str(tmp_path / "many"), timeout=8)
    # the run's output is closed: every rank that started is gone
    for path in tmp_path.glob("pid*"):
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(int(path.read_text()), 0)
                __import__("time").sleep(0.1)


@pytest.mark.slow
def test_the_probe_ends_a_rank_whose_data_loader_workers_are_alive(tmp_path):
    """The recorded run ends by killing its DataLoader workers; the DataLoader's SIGCHLD handler
    must not turn their deaths into "worker killed by signal" (CI saw it once; here the window
    between the kill and the exit is widened to a second, so the handler would always run)."""
    script = tmp_path / "workers.py"
    script.write_text(
        "import os, time, torch, ddpkit\n"
        "exit_now = os._exit\n"
        "os._exit = lambda code: (time.sleep(1.0), exit_now(code))\n"
        "rt = ddpkit.setup(seed=0)\n"
        "model = rt.wrap(torch.nn.Linear(4, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))\n"
        "for x, y in rt.loader(data, 8, num_workers=2):\n"
        "    (model(x) - y).pow(2).mean().backward(); opt.step(); opt.zero_grad()\n")
    record = run_script(str(script), [], 1, 2, str(tmp_path / "one"), timeout=120)
    assert len(record.steps) == 2


def test_a_rank_that_fails_is_told_by_its_exception_line_not_traceback():
    from ddpkit.verify.runs import _failed

    stderr = ("[rank 1] Traceback (most recent call last):\n"
              "[rank 1]   File \"train.py\", line 65, in main\n"
              "[rank 1]     scaler.step(opt)\n"
              "[rank 1]     ^^^^^^^^^^^^^^^^\n"
              "[rank 1] RuntimeError: DataLoader worker (pid 6849) is killed by signal: Killed. \n"
              "ddpkit run: rank 1 failed (exit code 1; its error is printed above)\n")
    def record(started):
        return RunRecord(world_size=2, steps=[], seeds=[], seeded=True, loaders=[], models=[],
                         foreign_loader=False, started=started)

    said = _failed("train.py", 2, stderr, record(True))
    assert said == ("train.py failed on 2 process(es) after 0 recorded step(s): [rank 1] "
                    "RuntimeError: DataLoader worker (pid 6849) is killed by signal: Killed. "
                    "(at train.py:65)")   # the script's own line, from its traceback
    said = _failed("train.py", 2, "error: --foo is not known\n[rank 0] x\n", record(False))
    assert said.endswith("at start-up: --foo is not known")


# ---------------------------------------------------------------- evidence before a name
def test_a_loss_that_differs_without_evidence_is_unexplained_not_a_guess():
    """Same samples, same model, nothing random: without per-rank target counts that differ
    there is no evidence of a mean of means, so none is named."""
    verdict = compare(_run([1.0]), _run([1.3], world=2))
    assert verdict.cause == "unexplained" and "first part at the loss (1 on 1 process, 1.3 " \
        "on 2)" in verdict.why and "the samples, what the forward received" in verdict.why
    assert "no cross_entropy/nll_loss call seen" in verdict.why   # built from this run
    assert any(line.startswith("loss 1 on 1 process, 1.3 on 2") for line in verdict.evidence)
    counted = _run([1.3], world=2)
    counted.steps[0].loss_counts = [[["mean", 187]], [["mean", 203]]]
    verdict = compare(_run([1.0]), counted)
    assert verdict.cause == "mean-of-means" and "187, 203" in verdict.why


def test_every_rank_on_the_same_samples_fails_even_when_the_steps_agree():
    one, many = _run([1.0, 1.0]), _run([1.0, 1.0], world=2)
    for step in many.steps:
        step.rows = [[11, 12, 13], [13, 12, 11]]
    many.foreign_loader = True
    verdict = compare(one, many)
    assert not verdict.passed and verdict.cause == "same-samples"
    assert "DistributedSampler" in verdict.why and verdict.first_divergent is None
    for step in many.steps:  # one rank differs: no finding
        step.rows = [[11, 12, 13], [14, 15, 16]]
    assert compare(one, many).passed


def test_ranks_holding_different_buffers_are_named_with_the_buffer():
    one, many = _run([1.0]), _run([1.2], world=2)
    many.states = [{"w": 1, "buffer:proj": 5}, {"w": 1, "buffer:proj": 6}]
    verdict = compare(one, many)
    assert verdict.cause == "ranks-differ" and "'proj'" in verdict.why
    assert "broadcast_buffers" in verdict.why


def test_no_step_on_n_processes_is_a_fail_naming_the_data_path():
    one, many = _run([1.0, 1.0]), _run([], world=2)
    many.exits = [{"batches": 16, "forwards": 0, "rows": 0, "step": 0}] * 2
    verdict = compare(one, many, steps=2)
    assert not verdict.passed and verdict.cause == "no-steps"
    assert "16 batch(es)" in verdict.evidence[0] and "collate_fn" in verdict.why


def test_an_evaluation_that_sees_fewer_samples_fails_and_duplicates_do_not():
    one, many = _run([1.0]), _run([1.0], world=2)
    one.evals = [[list(range(10))]]
    many.evals = [[list(range(5))], []]  # rank 0 alone, on its half
    verdict = compare(one, many)
    assert verdict.cause == "evaluation" and "only rank 0 evaluates" in verdict.why
    many.evals = [[list(range(6))], [list(range(5, 10)) + [0]]]  # padding duplicates: all seen
    assert compare(one, many).passed
    many.evals = [[list(range(20, 25))], [list(range(30, 35))]]  # augmented at random: counted
    assert compare(one, many).passed


def test_a_printed_metric_is_named_only_when_a_sum_collective_returned_it():
    from ddpkit.verify.metrics import numbers, template
    assert template("epoch 3 loss 2.30") == "epoch # loss #"
    assert numbers("loss 2.3026 acc 51.5%") == [(2.3026, pytest.approx(5e-5)), (51.5, 0.05)]
    one, many = _run([1.0]), _run([1.0], world=2)
    one.prints = [["val loss 1.3971"]]
    many.prints = [["val loss 2.7942"], []]
    assert compare(one, many).passed  # twice, but no collective returned it: no name
    many.collectives = [[{"fn": "all_reduce", "op": "SUM", "site": "t.py:9", "grad": None,
                          "after": [2.79421, 0.5], "phase": "eval"}], []]
    verdict = compare(one, many)
    assert verdict.cause == "metric-summed" and "t.py:9" in verdict.why


def test_row_digests_are_per_sample_and_independent_of_the_split():
    import torch

    from ddpkit.verify.probe_watch import first_tensor, row_digests
    x = torch.randn(6, 3, 4)
    assert sorted(row_digests(x)) == sorted(row_digests(x[:3]) + row_digests(x[3:].flip(0)))
    assert len(set(row_digests(x))) == 6 and row_digests(torch.tensor(1.0)) == []
    assert row_digests(x.bfloat16()) and row_digests(torch.ones(2, dtype=torch.bool))
    assert first_tensor(((), {"input_ids": x})) is x


def test_attention_dropout_inside_torch_modules_is_turned_off(monkeypatch):
    import torch
    from torch import nn

    from ddpkit.verify.probe_watch import quiet_attention
    functional = nn.functional  # put back after the test: verify patches it for its runs only
    monkeypatch.setattr(functional, "scaled_dot_product_attention",
                        functional.scaled_dot_product_attention)
    said = []
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
    assert quiet_attention(layer, lambda: said.append(1)) == 1 and layer.self_attn.dropout == 0
    q = torch.randn(1, 2, 4, 8)
    state = torch.random.get_rng_state()
    out = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert torch.equal(state, torch.random.get_rng_state()) and said  # no mask drawn
    assert torch.allclose(out, nn.functional.scaled_dot_product_attention(q, q, q))


WILD = os.path.join(ROOT, "tests", "verify_wild")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["lm_encoder_dropout.py", "nanogpt_sdpa.py"])
def test_correct_language_models_with_attention_dropout_pass(tmp_path, script):
    """Held-out scripts (tests/verify_wild: written without seeing verify) built on
    nn.TransformerEncoderLayer and on scaled_dot_product_attention(dropout_p=...): dropout
    inside torch's own attention is turned off like nn.Dropout, and the PASS says so."""
    path = os.path.join(WILD, script)
    one, reordered = (run_script(path, [], 1, 3, str(tmp_path / name), reverse=name == "r",
                                 timeout=240) for name in ("one", "r"))
    many = run_script(path, [], 2, 3, str(tmp_path / "many"), whole_epoch=False, timeout=240)
    verdict = compare(one, many, reordered, steps=3)
    assert verdict.passed, (verdict.cause, verdict.why, verdict.steps)
    assert any(note.startswith("dropout off") for note in verdict.notes), verdict.notes


@pytest.mark.slow
def test_a_script_that_hangs_only_on_n_processes_is_a_fail_not_a_usage_error():
    """A collective under `if rank == 0:` (examples/broken/rank0_collective.py): 1 process
    trains, 2 hang (or the launcher reports the stuck rank): a 1-vs-N divergence, exit 1 with
    its evidence, never exit 2."""
    proc = _ddpkit("verify", "--steps", "3", "--timeout", "30",
                   os.path.join(BROKEN, "rank0_collective.py"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(("FAIL [hangs-on-n]", "FAIL [fails-on-n]")), proc.stdout
    assert "evidence: 1 process: 3 optimizer steps recorded" in proc.stdout, proc.stdout
