"""Every engine's checkpoint resumed through every entry point: `ddpkit train`, ``fit`` and a
script's own loop, at the same and at another world size. A check added for one kind of checkpoint
(the refusal of a plain state_dict as ``--resume``) once refused FSDP's sharded checkpoints, which
hold no ``model`` key: every user's FSDP run of ``ddpkit train`` could not be resumed."""
import json
import os
import re

import pytest

import ddpkit
import own_loop_script
from ddpkit.checkpoint.files import holds_run, load_checkpoint
from test_cli import ddpkit as run_cli
from test_resume import effective_samples

pytestmark = pytest.mark.slow

# (world size, epochs) of the three attempts: written, resumed on as many ranks, then on another
# number. The "none" engine (no wrapper) starts on one process.
ROUNDS = {"ddp": [(2, 1), (2, 2), (1, 3)], "fsdp": [(2, 1), (2, 2), (1, 3)],
          "none": [(1, 1), (1, 2), (2, 3)]}


def _attempt(out, entry, engine, epochs, attempt):
    args = own_loop_script.parser().parse_args(  # the script's defaults: new options come along
        ["--out", out, "--epochs", str(epochs), "--hidden", "16", "--attempt", str(attempt)])
    rt = ddpkit.setup(seed=0, deterministic=True, engine=engine)
    try:
        _, steps, _ = (own_loop_script.with_fit if entry == "fit" else
                       own_loop_script.own_loop)(rt, args)
        return steps
    finally:
        rt.shutdown()


def _starts(out, attempt):
    """Where each rank of ``attempt`` began: (epoch, samples done), from its ledger."""
    found = []
    for name in sorted(os.listdir(out)):
        if re.fullmatch(rf"ledger-r\d+-a{attempt}-w\d+\.jsonl", name):
            with open(os.path.join(out, name)) as f:
                found.append(tuple(json.loads(f.readline())["start"]))
    return set(found)


@pytest.mark.parametrize("engine", list(ROUNDS))
@pytest.mark.parametrize("entry", ["fit", "own"])
def test_library_checkpoints_resume_through_fit_and_an_own_loop(tmp_path, entry, engine):
    for attempt, (world, epochs) in enumerate(ROUNDS[engine]):
        ddpkit.launch(_attempt, world, str(tmp_path), entry, engine, epochs, attempt, timeout=240)
        if attempt:  # resumed where the attempt before ended: the next epoch, or its last one
            (epoch, done), = _starts(tmp_path, attempt)   # done (an own loop's closing save)
            assert (epoch, done) == (epochs - 1, 0) or (
                epoch == epochs - 2 and done >= own_loop_script.SAMPLES), (epoch, done)
    ckpts = sorted((tmp_path / "ckpt").glob("ckpt-*.pt"))
    assert ckpts and holds_run(load_checkpoint(ckpts[-1]))
    per_epoch = effective_samples(str(tmp_path))
    assert sorted(per_epoch) == [0, 1, 2]
    for epoch, idx in per_epoch.items():
        assert set(idx) == set(range(own_loop_script.SAMPLES)), f"epoch {epoch}"


def _resumed_step(res):
    found = re.search(r"resumed from \S+ckpt-(\d+)\.pt at step (\d+)", res.stdout + res.stderr)
    return found and int(found.group(2))


@pytest.mark.parametrize("engine", list(ROUNDS))
def test_train_job_checkpoints_resume_on_as_many_and_on_another_number_of_processes(tmp_path,
                                                                                   engine):
    out = str(tmp_path / "run")
    config = os.path.join(out, "config.json")
    steps_done = 0
    for attempt, (world, epochs) in enumerate(ROUNDS[engine]):
        flags = (["--config", config, "--resume", "auto"] if attempt else
                 ["--engine", engine, "--output", out, "--ckpt-every-steps", "10",
                  "--batch-size", "128"])
        res = run_cli("train", *flags, "--nproc", str(world), "--epochs", str(epochs),
                      timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        if attempt:
            assert _resumed_step(res) == steps_done, res.stdout[-2000:] + res.stderr[-2000:]
        steps_done = json.load(open(os.path.join(out, "results.json")))["steps"]
    assert steps_done == 3 * -(-1438 // 128)  # digits: 12 steps of 128 an epoch, whatever the world
