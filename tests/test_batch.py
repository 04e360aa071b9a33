"""The batch as one value (data/batch.py's Batch), in one process: decided and checked once,
carried by the loader, recorded by checkpoints (an older checkpoint's record still resumes), and
read by the resume line, the progress bar, ddpkit verify, ddpkit bench and evaluate."""
import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.base.errors import ConfigError
from ddpkit.checkpoint.advice import world_change_line
from ddpkit.checkpoint.files import list_checkpoints, load_checkpoint, save_checkpoint
from ddpkit.data.batch import Batch
from ddpkit.data.loader import make_loader
from ddpkit.env.detect import ClusterEnv
from test_loop import data, model, runtime


def _env(rank, world):
    return ClusterEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)


# --------------------------------------------------------------------------- the value


@pytest.mark.parametrize("size,world,accum,micro", [(256, 4, 1, 64), (256, 4, 2, 32),
                                                    (16, 1, 4, 4), (12, 3, 2, 2)])
def test_a_batch_is_split_once_into_its_four_numbers(size, world, accum, micro):
    batch = Batch.of(size, world, accum)
    assert (batch.global_batch, batch.world_size, batch.accum_steps, batch.micro_batch) == \
        (size, world, accum, micro)
    assert batch.per_rank == micro * accum and batch.per_micro_step == micro * world
    assert Batch.recorded({"batch": batch.as_dict()}) == batch


def test_a_rank_s_micro_batch_gives_the_global_batch_it_makes():
    assert Batch.of(999, 2, 4, per_rank_batch=3) == Batch(24, 2, 4, 3)


def test_a_batch_that_does_not_split_is_the_split_rule_s_one_line():
    with pytest.raises(ConfigError) as exc:
        Batch.of(10, 4)
    assert str(exc.value) == ("batch_size=10 cannot be split evenly over 4 processes; use "
                              "batch_size=8 or 12, or give per_rank_batch= a rank's own batch")
    with pytest.raises(ConfigError, match=r"^per_rank_batch must be >= 1, got 0$"):
        Batch.of(8, 2, per_rank_batch=0)
    with pytest.raises(ConfigError, match=r"^accum_steps must be >= 1, got 0$"):
        Batch.of(8, 2, 0, per_rank_batch=2)


def test_four_numbers_that_do_not_agree_are_refused_in_one_line():
    with pytest.raises(ConfigError) as exc:
        Batch(16, 2, 4, 4)
    assert str(exc.value) == ("a global batch of 16 is not 4 a micro-batch x 2 rank(s) x 4 "
                              "accumulation step(s)")
    with pytest.raises(ConfigError, match="^world_size must be an integer >= 1, got 0$"):
        Batch(4, 0, 1, 4)
    with pytest.raises(ConfigError, match=r"^micro_batch must be an integer >= 1, got 2\.5$"):
        Batch(5, 1, 2, 2.5)


def test_a_numpy_integer_is_a_size_like_any_other():
    np = pytest.importorskip("numpy")
    batch = Batch.of(np.int64(16), 2, np.int64(2))
    assert batch == Batch(16, 2, 2, 4) and type(batch.micro_batch) is int


def test_a_checkpoint_from_before_the_record_has_no_batch_to_read():
    assert Batch.recorded({"step": 3, "global_batch": 4}) is None
    assert Batch.recorded({"batch": {"global_batch": 16}}) is None       # not whole
    assert Batch.recorded({"batch": {"global_batch": 15, "world_size": 1, "accum_steps": 4,
                                     "micro_batch": 4}}) is None         # not one that adds up


# --------------------------------------------------------------------------- the loader


def test_the_loader_carries_the_batch_and_torch_s_batch_size_is_the_micro_batch():
    loader = make_loader(list(range(40)), 16, _env(0, 1), accum_steps=4)
    assert loader.batch == Batch(16, 1, 4, 4) and loader.batch_size == 4
    loader = make_loader(list(range(40)), 16, _env(1, 2), accum_steps=2)
    assert loader.batch == Batch(16, 2, 2, 4) and loader.batch_size == 4
    loader = make_loader(list(range(40)), 0, _env(0, 2), accum_steps=2, per_rank_batch=3)
    assert loader.batch == Batch(12, 2, 2, 3) and loader.batch_size == 3


class _Watch:
    """Stands in for ddpkit verify's observer: takes the loader, accumulates ``accum`` ranks."""

    def __init__(self, accum):
        self.accum, self.records = accum, []

    def claim_loader(self):
        return True

    def loader(self, record, dataset):
        self.records.append(record)


@pytest.mark.parametrize("world", [1, 2])
def test_verify_records_the_same_step_batch_on_1_process_as_on_2(world, monkeypatch):
    from ddpkit.base import observe

    watch = _Watch(accum=2)   # --accum-steps 2: 1 process takes 2 ranks' batches a step
    monkeypatch.setattr(observe, "_ACTIVE", watch)
    loader = make_loader(list(range(40)), 16, _env(0, world), accum_steps=2)
    assert loader.batch == (Batch(16, 1, 4, 4) if world == 1 else Batch(16, 2, 2, 4))
    assert loader.batch_size == loader.batch.micro_batch
    assert watch.records[0]["global_batch"] == 16
    assert watch.records[0]["batch"] == loader.batch.as_dict()


# --------------------------------------------------------------------------- checkpoints


def _train(directory, steps, batch_size=16, accum_steps=4):
    """``steps`` optimizer steps of an own loop with accumulation, a checkpoint after each."""
    rt, net = runtime(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = rt.loader(data(), batch_size, accum_steps=accum_steps, shuffle=False)
    ckpt = rt.checkpointer(directory, model=net, optimizer=opt, loader=loader, every_steps=1)
    micro = 0
    while ckpt.global_step < steps:
        for x, y in loader:
            (nn.functional.cross_entropy(net(x), y) / accum_steps).backward()
            micro += 1
            if micro % accum_steps == 0:
                opt.step()
                opt.zero_grad()
                ckpt.step()
                if ckpt.global_step == steps:
                    break
    return ckpt, loader


def test_a_checkpoint_records_the_true_global_batch_with_accumulation(tmp_path):
    # Once: loader.batch_size x world size, 4 for rt.loader(ds, batch_size=16, accum_steps=4).
    ckpt, _ = _train(tmp_path, 1)
    progress = load_checkpoint(list_checkpoints(tmp_path)[-1])["progress"]
    assert progress["global_batch"] == 16
    assert progress["batch"] == {"global_batch": 16, "world_size": 1, "accum_steps": 4,
                                 "micro_batch": 4}
    ckpt.close()


def _as_written_before(path, world_size=None):
    """Rewrite ``path`` as ddpkit wrote it before the batch was recorded: ``global_batch``
    alone, the loader's micro-batch x the world size (optionally another world's)."""
    state = load_checkpoint(path)
    progress = state["progress"]
    batch = progress.pop("batch")
    # a micro-batch x the world size: on any world size, the global batch / accumulation steps
    progress["global_batch"] = batch["global_batch"] // batch["accum_steps"]
    if world_size:
        state["world_size"] = world_size
    save_checkpoint(state, path.parent, int(progress["step"]))
    return state


def test_a_checkpoint_written_before_the_change_still_resumes(tmp_path, capsys):
    _train(tmp_path, 3)[0].close()
    path = list_checkpoints(tmp_path)[-1]
    old = _as_written_before(path)
    assert set(old["progress"]) >= {"global_batch"} and "batch" not in old["progress"]
    assert old["progress"]["global_batch"] == 4     # the old record: 4 a rank x 1 rank
    capsys.readouterr()
    ckpt, loader = _train(tmp_path, 5)
    out = capsys.readouterr().out
    assert f"resumed from {path} at step 3" in out
    assert ckpt.global_step == 5 and loader.batch == Batch(16, 1, 4, 4)
    ckpt.close()
    # what it writes from then on says the whole batch
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["progress"]["global_batch"] == 16


def test_an_old_checkpoint_from_another_world_size_says_how_the_batch_is_split(tmp_path, capsys):
    _train(tmp_path, 2)[0].close()
    path = list_checkpoints(tmp_path)[-1]
    old = _as_written_before(path, world_size=2)   # as 2 ranks wrote it: 2 a rank x 2 ranks
    assert old["progress"]["global_batch"] == 4
    capsys.readouterr()
    _train(tmp_path, 3)[0].close()
    out = capsys.readouterr().out
    assert ("resumed at step 2 on 1 processes (the checkpoint was written by 2); each batch "
            "still spans 16 samples: 16 a rank in 4 micro-batches of 4, was 8; the epoch goes "
            "on with every sample once") in out


def test_the_resume_line_reads_the_recorded_batch():
    loader = make_loader(list(range(40)), 16, _env(0, 1), accum_steps=4)
    same = world_change_line(2, 1, 9, loader, saved_batch=Batch(16, 2, 4, 2))
    assert "each batch still spans 16 samples: 16 a rank in 4 micro-batches of 4, was 8;" in same
    other = world_change_line(2, 1, 9, loader, saved_batch=Batch(32, 2, 4, 4))
    assert "each batch now spans 16 samples (16 a rank in 4 micro-batches of 4), was 32 " \
           "(16 a rank);" in other


# --------------------------------------------------------------------------- the readers


def test_the_progress_bar_counts_a_micro_step_of_every_rank():
    loader = make_loader(list(range(40)), 16, _env(0, 2), accum_steps=4)
    assert loader.batch.per_micro_step == loader.batch_size * 2 == 4


def test_evaluate_s_batch_is_per_rank_under_either_name():
    net, val = model(), data(13, seed=1)
    by_new = ddpkit.evaluate(net, val, per_rank_batch=4)
    assert ddpkit.evaluate(net, val, batch_size=4) == by_new   # the older name, the same
    assert runtime().evaluate(net, val, per_rank_batch=4) == by_new
    with pytest.raises(ConfigError) as exc:
        ddpkit.evaluate(net, val, per_rank_batch=4, batch_size=8)
    assert str(exc.value) == ("evaluate: per_rank_batch=4 and batch_size=8 name the same "
                              "number (a rank's batch); give one")
    with pytest.raises(ConfigError, match="^evaluate: per_rank_batch must be >= 1, got 0$"):
        ddpkit.evaluate(net, val, per_rank_batch=0)


def test_verify_checks_nproc_against_the_script_s_batch_and_accumulation():
    from ddpkit.verify.records import RunRecord
    from ddpkit.verify.runs import _check_divides

    def one(batch, micro_steps=1):
        return RunRecord(world_size=1, steps=[], seeds=[0], seeded=True, models=[],
                         foreign_loader=False, started=True,
                         loaders=[{"global_batch": batch.global_batch, "batch": batch.as_dict(),
                                   "micro_steps": micro_steps}])

    _check_divides(one(Batch.of(16, 1, 2)), 2)                  # 4 a rank a micro-batch
    with pytest.raises(ConfigError) as exc:                     # 12 / (2 ranks x 4) is not whole
        _check_divides(one(Batch.of(12, 1, 4)), 2)
    assert str(exc.value) == ("--nproc 2 does not divide the script's global batch of 12 in 4 "
                              "accumulation steps (rt.loader): pass --nproc 3")
    # a 1-process run of --accum-steps 2 took the script's 4 steps as 8
    _check_divides(one(Batch(16, 1, 8, 2), micro_steps=2), 2)


def test_bench_s_batch_flag_says_per_rank_and_the_old_spelling_still_works():
    import argparse

    from ddpkit.bench.rows import ROWS, BenchConfig, plan_row
    from ddpkit.cli.bench import add_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    new = config_from_args(parser.parse_args(["bench", "--per-rank-batch", "32"]))
    assert new.batch == 32 == config_from_args(parser.parse_args(["bench", "--batch", "32"])).batch
    caps = {"cuda_count": 0, "horovod_missing": "no", "native_bf16": False, "bf16_slowdown": 9.0}
    cfg = BenchConfig(nproc=2, batch=32, accum_steps=4)
    assert plan_row(ROWS["ddp"], cfg, caps)["global_batch"] == 64
    with pytest.raises(ConfigError, match=r"^--per-rank-batch must be >= 1, got 0$"):
        BenchConfig(batch=0).check()


def test_fit_accumulating_over_a_plain_loader_records_the_step_s_batch(tmp_path):
    # rt.loader(batch_size=8) then fit(accum_steps=2): each optimizer step takes 2 of its
    # batches, so the step's batch is 16, and the checkpoint says so
    rt = runtime()
    loader = rt.loader(data(), batch_size=8)
    assert loader.batch == Batch(8, 1, 1, 8)
    net = model()
    ddpkit.fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), loader,
               ddpkit.FitConfig(epochs=1, accum_steps=2, progress=False,
                                checkpoint=ddpkit.CheckpointPolicy(str(tmp_path))))
    assert loader.batch == Batch(16, 1, 2, 8)
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["progress"]["global_batch"] == 16


def test_fit_refuses_a_loader_built_for_another_accumulation_in_one_line():
    rt = runtime()
    loader = rt.loader(data(), batch_size=16, accum_steps=4)
    net = model()
    with pytest.raises(ConfigError) as exc:
        ddpkit.fit(rt, net, torch.optim.SGD(net.parameters(), lr=0.1), loader,
                   ddpkit.FitConfig(epochs=1, accum_steps=2, progress=False))
    assert str(exc.value) == ("the loader was built with accum_steps=4 but fit accumulates "
                              "accum_steps=2; give both the same value")
