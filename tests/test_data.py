"""Batch splitting, samplers, DistributedLoader epochs/resume and worker seeding, in one process.

A DistributedLoader for rank r of N needs no process group (the sampler only uses
num_replicas/rank), so several ranks are simulated side by side in this process.
"""
import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

from ddpkit.data.batch import split_batch
from ddpkit.data.loader import (DistributedLoader, ResumableSampler, ShardSampler, make_loader,
                                worker_seed)
from ddpkit.env.detect import ClusterEnv
from ddpkit.base.errors import ConfigError


def _env(rank, world):
    return ClusterEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)


def _flat(batches):
    return [int(i) for b in batches for i in b]


def _reference(n, world, rank, epoch, *, seed=0, shuffle=True, drop_last=False):
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


# --------------------------------------------------------------------------- the batch rule


@pytest.mark.parametrize("global_batch,world,accum,expected",
                         [(256, 4, 1, 64), (7, 1, 1, 7), (6, 3, 1, 2), (8, 8, 1, 1),
                          (256, 4, 2, 32), (12, 1, 3, 4)])
def test_a_batch_is_the_global_batch_of_one_optimizer_step(global_batch, world, accum, expected):
    assert split_batch(global_batch, world, accum) == expected


def test_a_batch_that_does_not_split_names_sizes_that_do():
    with pytest.raises(ConfigError) as exc:
        split_batch(10, 4)
    assert str(exc.value) == ("batch_size=10 cannot be split evenly over 4 processes; use "
                              "batch_size=8 or 12, or give per_rank_batch= a rank's own batch")
    with pytest.raises(ConfigError, match=r"use batch_size=96 or 99, or give per_rank_batch="):
        split_batch(98, 3)
    with pytest.raises(ConfigError) as exc:  # accumulation: the per-process batch is what fails
        split_batch(10, 2, 2)
    assert str(exc.value).startswith("accum_steps=2 cannot split the per-process batch 5 "
                                     "(global 10 / 2 processes); use batch_size=8 or 12")
    for bad, world, accum in ((10, 4, 1), (98, 3, 1), (10, 2, 2), (3, 4, 1), (13, 3, 2)):
        with pytest.raises(ConfigError) as exc:
            split_batch(bad, world, accum)
        advice = str(exc.value).split("; use batch_size=")[1].split(",")[0]
        for size in advice.split(" or "):  # the advice is accepted by the same rule
            assert split_batch(int(size), world, accum) * world * accum == int(size)


def test_a_batch_smaller_than_the_world_suggests_the_world_size_once():
    with pytest.raises(ConfigError) as exc:
        split_batch(3, 4)
    assert "use batch_size=4," in str(exc.value) and "4 or 4" not in str(exc.value)


@pytest.mark.parametrize("bad", [0, -8])
def test_the_batch_size_must_be_positive(bad):
    with pytest.raises(ConfigError) as exc:
        split_batch(bad, 2)
    assert str(exc.value) == f"batch_size must be >= 1, got {bad}"
    with pytest.raises(ConfigError, match=f"accum_steps must be >= 1, got {bad}"):
        split_batch(4, 2, bad)


def test_the_loader_takes_the_batch_of_a_step_and_its_micro_steps():
    loader = make_loader(list(range(N)), 8, _env(0, 2), accum_steps=2)
    assert loader.batch_size == 2
    with pytest.raises(ConfigError, match="accum_steps=3 cannot split the per-process batch 4"):
        make_loader(list(range(N)), 8, _env(0, 2), accum_steps=3)


# --------------------------------------------------------------------------- ShardSampler


@pytest.mark.parametrize("world", range(1, 8))
def test_shard_sampler_covers_every_index_once(world):
    for length in list(range(0, 23)) + [100, 101]:
        shards = [list(ShardSampler(length, world, r)) for r in range(world)]
        assert list(itertools.chain(*shards)) == list(range(length)), (length, world)
        sizes = [len(ShardSampler(length, world, r)) for r in range(world)]
        assert sizes == [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # the larger blocks come first


def test_shard_sampler_examples():
    assert [list(ShardSampler(7, 3, r)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(ShardSampler(2, 4, r)) for r in range(4)] == [[0], [1], [], []]
    assert [len(ShardSampler(0, 3, r)) for r in range(3)] == [0, 0, 0]
    assert list(ShardSampler(5)) == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- ResumableSampler


COMBOS = [  # n, world, shuffle, drop_last, seed, epoch
    (10, 1, True, False, 0, 0), (10, 3, True, False, 0, 0), (10, 3, True, True, 0, 0),
    (10, 4, False, False, 0, 0), (10, 4, False, True, 0, 0), (11, 4, True, False, 5, 3),
    (12, 4, True, True, 5, 3), (3, 5, True, False, 1, 2), (3, 5, True, True, 1, 2),
    (1, 8, False, False, 0, 0), (0, 3, True, False, 0, 0), (37, 6, True, False, 42, 7),
    (37, 6, True, True, 42, 7), (64, 8, True, False, 123, 1),
]


@pytest.mark.parametrize("n,world,shuffle,drop_last,seed,epoch", COMBOS)
def test_resumable_sampler_matches_distributed_sampler(n, world, shuffle, drop_last, seed, epoch):
    for rank in range(world):
        ours = ResumableSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                seed=seed, drop_last=drop_last)
        ours.set_epoch(epoch)
        expected = _reference(n, world, rank, epoch, seed=seed, shuffle=shuffle, drop_last=drop_last)
        assert len(ours) == len(expected) == ours.num_samples
        assert list(ours) == expected
        assert list(ours) == expected  # iterating twice gives the same epoch


def test_skip_applies_to_one_pass_only():
    s = ResumableSampler(range(10), num_replicas=2, rank=0, seed=3)
    s.set_epoch(1)
    full = list(s)
    s.skip(4)
    assert len(s) == 3
    assert list(s) == full[2:]  # 4 global positions = 2 per rank
    assert len(s) == 5 and list(s) == full


def _perm(n, seed, epoch):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


@pytest.mark.parametrize("n,old_world,k,b,new_world", [
    (50, 2, 3, 4, 3), (50, 4, 2, 3, 2), (50, 3, 1, 5, 7), (50, 1, 7, 3, 4),
    (17, 2, 2, 2, 5), (17, 4, 1, 1, 4), (17, 3, 2, 2, 1), (16, 8, 1, 1, 3),
    (100, 5, 3, 6, 6), (9, 2, 1, 4, 8),
])
def test_resume_on_a_different_world_size_loses_and_repeats_nothing(n, old_world, k, b, new_world):
    seed, epoch = 11, 2
    perm = _perm(n, seed, epoch)
    consumed_positions = old_world * k * b
    # what old_world ranks consumed after k batches of b each
    consumed = []
    for rank in range(old_world):
        s = ResumableSampler(range(n), num_replicas=old_world, rank=rank, seed=seed)
        s.set_epoch(epoch)
        consumed += list(s)[: k * b]
    assert sorted(consumed) == sorted(perm[:consumed_positions])  # exactly the prefix
    # the remainder, on new_world ranks
    rest = []
    for rank in range(new_world):
        s = ResumableSampler(range(n), num_replicas=new_world, rank=rank, seed=seed)
        s.set_epoch(epoch)
        s.skip(consumed_positions)
        expected_len = len(s)
        got = list(s)
        assert len(got) == expected_len
        rest += got
    remaining = perm[consumed_positions:]
    pad = (-len(remaining)) % new_world
    assert len(rest) == len(remaining) + pad
    counts = Counter(rest)
    assert set(counts) == set(remaining)                       # nothing lost
    assert sum(c - 1 for c in counts.values()) == pad          # repeats only as padding
    assert not set(rest) & set(consumed)                       # nothing seen twice
    assert sorted(set(rest) | set(consumed)) == list(range(n))


@pytest.mark.parametrize("n,old_world,k,b,new_world", [(50, 2, 3, 4, 3), (17, 2, 2, 2, 5),
                                                        (30, 3, 2, 2, 4)])
def test_resume_with_drop_last_repeats_nothing(n, old_world, k, b, new_world):
    perm = _perm(n, 0, 0)
    skipped = old_world * k * b
    rest = []
    for rank in range(new_world):
        s = ResumableSampler(range(n), num_replicas=new_world, rank=rank, drop_last=True)
        s.skip(skipped)
        rest += list(s)
    remaining = perm[skipped:]
    assert len(rest) == len(remaining) // new_world * new_world
    assert len(set(rest)) == len(rest)
    assert sorted(rest) == sorted(remaining[: len(rest)])


def test_skip_past_the_end_is_empty():
    s = ResumableSampler(range(10), num_replicas=2, rank=1)
    s.skip(12)
    assert len(s) == 0 and list(s) == []


# --------------------------------------------------------------------------- DistributedLoader


N = 22  # samples in the toy dataset


def _loader(rank=0, world=2, batch=4, seed=7, **kw):
    return make_loader(list(range(N)), batch, _env(rank, world), seed=seed, **kw)


def test_make_loader_without_process_group():
    loader = _loader(rank=1, world=2, batch=4)
    assert isinstance(loader, DistributedLoader)
    assert loader.batch_size == 2 and loader.rank == 1
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 1)
    batches = list(loader)
    assert [len(b) for b in batches] == [2, 2, 2, 2, 2, 1]
    assert _flat(batches) == _reference(N, 2, 1, 0, seed=7)


def test_make_loader_explicit_per_rank_batch():
    loader = make_loader(list(range(N)), 999, _env(0, 2), per_rank_batch=3)
    assert loader.batch_size == 3 and len(loader) == 4


def test_make_loader_checks_global_batch_and_workers():
    with pytest.raises(ConfigError, match="batch_size=5 cannot be split evenly over 2 processes"):
        make_loader(list(range(N)), 5, _env(0, 2))
    with pytest.raises(ConfigError) as exc:
        make_loader(list(range(N)), 4, _env(0, 2), num_workers=-1)
    assert str(exc.value) == "number of loader workers must be >= 0, got -1"


@pytest.mark.parametrize("world,batch,drop_last,expected", [
    (2, 4, False, 6), (2, 4, True, 5), (1, 4, False, 6), (1, 4, True, 5), (4, 8, False, 3),
    (4, 8, True, 2), (3, 3, False, 8),
])
def test_len(world, batch, drop_last, expected):
    loader = _loader(world=world, batch=batch, drop_last=drop_last)
    assert len(loader) == expected == len(list(loader))


def test_epochs_advance_automatically():
    loader = _loader(rank=0)
    passes = [_flat(loader) for _ in range(3)]
    assert loader.epoch == 2
    for epoch, got in enumerate(passes):
        assert got == _reference(N, 2, 0, epoch, seed=7)
    assert passes[0] != passes[1] != passes[2]


def test_unshuffled_loader_keeps_order():
    loader = _loader(rank=1, shuffle=False)
    assert _flat(loader) == _flat(loader) == list(range(1, N, 2))


def test_different_seeds_shuffle_differently():
    assert _flat(_loader(seed=1)) != _flat(_loader(seed=2))


def test_set_epoch():
    loader = _loader(rank=1)
    next(iter(loader))  # a partly consumed pass is abandoned by set_epoch
    loader.set_epoch(5)
    assert _flat(loader) == _reference(N, 2, 1, 5, seed=7)
    assert loader.epoch == 5
    assert _flat(loader) == _reference(N, 2, 1, 6, seed=7)


def test_state_dict_names_the_epoch_the_next_batch_belongs_to():
    loader = _loader()
    assert loader.state_dict() == {"epoch": 0, "samples_done": 0, "pad_base": 0, "world_size": 2,
                                   "seed": 7}
    it = iter(loader)
    batches = [next(it) for _ in range(len(loader))]  # the last batch handed out, pass not over
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["samples_done"] >= N
    assert list(it) == []                              # the pass is over: the next epoch, from 0
    assert loader.state_dict() == {"epoch": 1, "samples_done": 0, "pad_base": 0, "world_size": 2,
                                   "seed": 7}
    assert len(batches) == len(loader)


def test_set_epoch_keeps_a_resume_into_the_same_epoch():
    # Scripts written for DistributedSampler call set_epoch(epoch) themselves at each epoch.
    a = _loader(rank=1)
    it = iter(a)
    first = [next(it), next(it)]
    b = _loader(rank=1)
    b.load_state_dict(a.state_dict())
    b.set_epoch(0)
    assert _flat(first) + _flat(b) == _reference(N, 2, 1, 0, seed=7)


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_mid_epoch_gives_the_rest_of_the_epoch(rank):
    a = _loader(rank=rank)
    list(a)  # epoch 0
    it = iter(a)
    first = [next(it), next(it)]
    state = a.state_dict()
    assert state == {"epoch": 1, "samples_done": 2 * 2 * 2, "pad_base": 0, "world_size": 2,
                     "seed": 7}
    b = _loader(rank=rank)
    b.load_state_dict(state)
    rest = list(b)
    assert b.epoch == 1
    assert _flat(first) + _flat(rest) == _reference(N, 2, rank, 1, seed=7)
    assert _flat(b) == _reference(N, 2, rank, 2, seed=7)  # then the next full epoch


def test_resume_on_more_ranks_through_loaders():
    old = [_loader(rank=r, world=2, batch=4) for r in range(2)]
    seen = []
    for loader in old:
        it = iter(loader)
        seen += _flat([next(it) for _ in range(3)])
    state = old[0].state_dict()
    assert state == old[1].state_dict()
    assert state["samples_done"] == 12
    rest = []
    for r in range(3):
        new = _loader(rank=r, world=3, batch=3)
        new.load_state_dict(state)
        rest += _flat(new)
    perm = _perm(N, 7, 0)
    assert sorted(seen) == sorted(perm[:12])
    remaining = perm[12:]  # 10 samples on 3 ranks: 2 padded
    assert len(rest) == 12 and set(rest) == set(remaining)
    assert not set(rest) & set(seen)


def test_load_state_dict_seed_mismatch():
    loader = _loader(seed=7)
    with pytest.raises(ConfigError) as exc:
        loader.load_state_dict({"epoch": 0, "samples_done": 4, "world_size": 2, "seed": 8})
    assert str(exc.value) == ("checkpoint was shuffled with seed 8, this run uses 7; resume with "
                              "the same seed")


def test_load_state_dict_without_seed_is_accepted():
    loader = _loader(rank=0)
    loader.load_state_dict({"epoch": 3, "samples_done": 8})
    assert _flat(loader) == _reference(N, 2, 0, 3, seed=7)[4:]


def test_at_last_batch():
    loader = _loader(rank=1)
    flags = [loader.at_last_batch for _ in loader]
    assert flags == [False] * 5 + [True]
    assert loader.at_last_batch  # still true after the pass ended


def test_at_last_batch_with_drop_last():
    loader = _loader(rank=0, drop_last=True)
    assert [loader.at_last_batch for _ in loader] == [False] * 4 + [True]


def test_at_last_batch_after_resume():
    loader = _loader(rank=0)
    loader.load_state_dict({"epoch": 0, "samples_done": 12, "seed": 7})
    flags = [loader.at_last_batch for _ in loader]
    assert flags == [False, False, True]  # (22 - 12) / 2 ranks = 5 samples = 3 batches of 2
    assert loader.pass_batches == 3 and len(loader) == 6


# --------------------------------------------------------------------------- worker seeding


def test_worker_seed_distinct_across_ranks_workers_and_seeds():
    seeds = [worker_seed(s, r, w) for s in range(3) for r in range(16) for w in range(8)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2 ** 63 for s in seeds)
    assert worker_seed(42, 1, 0) == worker_seed(42, 1, 0)
    assert worker_seed(2 ** 70, 3, 1) < 2 ** 63


class RandomDataset(Dataset):
    """Each item is a fresh draw from the worker's torch RNG."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.rand(1)


def _draws(rank, persistent, epochs=1):
    loader = make_loader(RandomDataset(), 2, _env(rank, 2), shuffle=False, num_workers=2,
                         persistent_workers=persistent)
    return [torch.cat(list(loader)).flatten().tolist() for _ in range(epochs)]


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_draw_differently_per_rank_and_worker(persistent):
    rank0, rank1 = _draws(0, persistent)[0], _draws(1, persistent)[0]
    assert len(rank0) == len(rank1) == 4  # 8 samples / 2 ranks, batches of 1 per rank
    assert len(set(rank0 + rank1)) == 8   # two workers on each of two ranks: all different
    assert _draws(0, persistent)[0] == rank0  # and reproducible


def test_persistent_workers_draw_differently_each_epoch():
    first, second = _draws(0, True, epochs=2)
    assert not set(first) & set(second)


def test_non_persistent_workers_draw_differently_each_epoch():
    first, second = _draws(0, False, epochs=2)
    assert not set(first) & set(second)


@pytest.mark.parametrize("n", [10, 11, 13])
def test_resume_mid_epoch_on_uneven_shards_gives_the_same_padded_tail(n):
    # n not divisible by 4 ranks: the padding repeats the head of the *whole* epoch, as the
    # uninterrupted run has it, not the head of what is left.
    def loader(rank):
        return make_loader(TensorDataset(torch.arange(n)), 4, ClusterEnv(rank=rank, world_size=4,
                           local_rank=rank), seed=3)
    for rank in range(4):
        whole = _flat(loader(rank))
        a = loader(rank)
        it = iter(a)
        first = [next(it)]
        b = loader(rank)
        b.load_state_dict(a.state_dict())
        assert _flat(first) + _flat(b) == whole


@pytest.mark.parametrize("key", ["sampler", "batch_sampler", "generator", "worker_init_fn"])
def test_loader_arguments_it_sets_itself_are_refused_in_one_line(key):
    with pytest.raises(ConfigError, match=f"rt.loader does not take {key}="):
        make_loader(TensorDataset(torch.arange(8)), 4, _env(0, 1), **{key: object()})


def test_pin_memory_given_by_the_user_wins():
    loader = make_loader(TensorDataset(torch.arange(8)), 4, _env(0, 1), pin_memory=False)
    assert loader.loader_kwargs["pin_memory"] is False
    assert sorted(int(i) for (b,) in loader for i in b) == list(range(8))


def test_set_epoch_of_another_epoch_after_a_restore_warns_that_the_position_is_dropped():
    a = _loader(rank=0)
    it = iter(a)
    next(it)
    b = _loader(rank=0)
    b.load_state_dict(a.state_dict())
    with pytest.warns(UserWarning, match="drops the resumed position .epoch 0, 4 samples done"):
        b.set_epoch(3)


@pytest.mark.slow
def test_a_script_with_loader_workers_exits_and_its_workers_leave_the_launchers_group():
    # Workers sit in their own process group (a launcher's SIGTERM to the rank's group must not
    # kill them before the rank saves), yet a script ends as usual: the parent stops them.
    import subprocess
    import sys
    script = (
        "import os, torch\n"
        "from torch.utils.data import Dataset\n"
        "from ddpkit.data.loader import make_loader\n"
        "from ddpkit.env.detect import ClusterEnv\n"
        "class D(Dataset):\n"
        "    def __len__(self): return 64\n"
        "    def __getitem__(self, i): return torch.tensor([os.getpgid(0), os.getpid()])\n"
        "loader = make_loader(D(), 8, ClusterEnv(), num_workers=2)\n"
        "groups = {int(g) for b in loader for g in b[:, 0]}\n"
        "assert os.getpgid(0) not in groups and len(groups) == 2, groups\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_a_loader_with_no_batch_is_one_line():
    # Issue 22 row 6: training would otherwise "finish" at once with a loss of 0.
    with pytest.raises(ConfigError, match="the dataset has 0 samples"):
        make_loader(TensorDataset(torch.zeros(0, 2)), 4, _env(0, 2))
    with pytest.raises(ConfigError, match=r"10 samples on 2 rank\(s\) with a global batch of 16 "
                                          r"and drop_last=True give no batch; use a batch of at "
                                          r"most 10 or drop_last=False"):
        make_loader(TensorDataset(torch.zeros(10, 2)), 16, _env(0, 2), drop_last=True)
    assert len(make_loader(TensorDataset(torch.zeros(10, 2)), 16, _env(0, 2))) == 1


class _Noisy(torch.utils.data.Dataset):
    """Each sample with noise from torch's, Python's and NumPy's global generators."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        import random as pyrandom

        import numpy as np
        return torch.tensor([float(i), float(torch.rand(())), pyrandom.random(),
                             float(np.random.rand())])


def _augmented(world, **kw):
    """Every sample's row as the ranks of a ``world`` draw it, by sample index."""
    rows = {}
    for rank in range(world):
        torch.manual_seed(100 + rank)  # the caller's streams differ: they must not matter
        for batch in make_loader(_Noisy(), 12, _env(rank, world), seed=3, **kw):
            rows.update({int(r[0]): r for r in batch})
    return rows


def test_seed_each_sample_augments_every_sample_alike_at_any_world_size():
    one, two = _augmented(1, seed_each_sample=True), _augmented(2, seed_each_sample=True)
    assert sorted(one) == sorted(two) == list(range(24))
    assert all(torch.equal(one[i], two[i]) for i in one)
    torch.manual_seed(7)   # the caller's stream (dropout, say) is left where it was
    before = torch.random.get_rng_state()
    list(make_loader(_Noisy(), 12, _env(0, 1), seed=3, seed_each_sample=True))
    assert torch.equal(torch.random.get_rng_state(), before)
    plain_one, plain_two = _augmented(1), _augmented(2)   # by default: depends on the split
    assert not all(torch.equal(plain_one[i], plain_two[i]) for i in plain_one)
