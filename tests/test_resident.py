"""Device-resident data (ddpkit.data.resident) on the CPU: the same logic a GPU runs, so CI proves it.

The loader must hand out the same samples as the ordinary one (same sampler, epochs, resume
position), gather batches from the device copy, and augment per sample from (seed, epoch) alone.
"""
import dataclasses

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import ddpkit
from ddpkit.data import resident
from ddpkit.data.loader import make_loader
from ddpkit.env.detect import ClusterEnv
from ddpkit.base.errors import ConfigError
from ddpkit.job.datasets import digits, synthetic
from ddpkit.job.images import InMemoryImages, crop_flip_draws
from ddpkit.job.train import train
from ddpkit.job.config import TrainConfig
from ddpkit.data.resident import ResidentData, choose_resident, resident_batches

CPU = torch.device("cpu")


def env(rank=0, world=1):
    return ClusterEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)


def cifar_like(n=200, augment=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
    return InMemoryImages(images, torch.randint(0, 10, (n,), generator=g), 10,
                          mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), augment=augment)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resident_loader_hands_out_exactly_what_the_dataloader_does(world, drop_last):
    ds = digits()  # no augmentation: both paths must give identical tensors
    for rank in range(world):
        plain = make_loader(ds, 96, env(rank, world), seed=3, drop_last=drop_last, resident=False)
        on_dev = make_loader(ds, 96, env(rank, world), seed=3, drop_last=drop_last, resident=True)
        assert plain.resident is None and on_dev.resident is not None
        assert len(plain) == len(on_dev)
        for _epoch in range(2):
            a, b = list(plain), list(on_dev)
            assert len(a) == len(b) == len(plain)
            for (xa, ya), (xb, yb) in zip(a, b):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_resident_loader_resumes_mid_epoch_at_the_same_sample():
    ds = TensorDataset(torch.arange(100).float().view(100, 1), torch.arange(100))
    first = make_loader(ds, 8, env(), seed=1, resident=True)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    rest = torch.cat([y for _, y in it])
    again = make_loader(ds, 8, env(), seed=1, resident=True)
    again.load_state_dict(state)
    assert torch.equal(torch.cat([y for _, y in again]), rest) and again.epoch == 0
    assert len(rest) == 100 - 4 * 8


def test_augmentation_depends_on_seed_epoch_and_sample_only():
    ds = cifar_like()
    data = choose_resident(ds, CPU, "on")
    order = torch.randperm(200, generator=torch.Generator().manual_seed(1)).tolist()
    whole = torch.cat([x for x, _ in resident_batches(data, order, 200, False, epoch=2, seed=5)])
    # In other batch sizes and shards (another world size): each sample's view is the same.
    split = torch.cat([x for x, _ in resident_batches(data, order, 7, False, epoch=2, seed=5)])
    assert torch.equal(whole, split)
    other_epoch = torch.cat([x for x, _ in resident_batches(data, order, 200, False, 3, 5)])
    assert not torch.equal(whole, other_epoch)
    # And it is the per-item transform of that sample with these crop and flip draws.
    draws = crop_flip_draws(5, 2, 200, ds.padding)
    i = order[11]
    top, left, flip = draws[i].tolist()
    img = torch.nn.functional.pad(ds.images[i].float().div(255), (4, 4, 4, 4))[:, top:top + 32,
                                                                                left:left + 32]
    img = img.flip(-1) if flip else img
    torch.testing.assert_close(whole[11], (img - ds.mean) / ds.std, rtol=0, atol=1e-6)


def test_synthetic_data_is_generated_on_the_device_once_and_deterministically():
    a, b = synthetic(64).resident(CPU), synthetic(64).resident(CPU)
    assert torch.equal(a.tensors[0], b.tensors[0]) and a.tensors[0].shape == (64, 3, 32, 32)
    assert not torch.equal(a.tensors[0], synthetic(64, train=False).resident(CPU).tensors[0])
    assert resident.resident_nbytes(synthetic(64)) == 64 * (4 * 3 * 32 * 32 + 8)


def test_auto_keeps_the_cpu_loader_on_cpu_and_off_means_off():
    assert choose_resident(digits(), CPU, "auto") is None
    assert choose_resident(digits(), CPU, "off") is None
    assert choose_resident(digits(), CPU, True) is not None


class ItemByItem(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(2), i


def test_forcing_an_item_by_item_dataset_is_one_line():
    assert choose_resident(ItemByItem(), CPU, "auto") is None
    with pytest.raises(ConfigError) as exc:
        choose_resident(ItemByItem(), CPU, "on")
    assert str(exc.value) == ("device-resident data needs an in-memory dataset (a TensorDataset, "
                              "digits, cifar10/100, synthetic); ItemByItem reads items one by "
                              "one: use --device-data off")


def test_data_too_large_for_the_device(monkeypatch):
    monkeypatch.setattr(resident, "free_device_bytes", lambda device: 2**20)  # 1 MiB free
    gpu = torch.device("cuda", 0)  # never touched: the size check comes first
    assert choose_resident(cifar_like(), gpu, "auto") is None  # 0.6 MiB > a quarter of it
    with pytest.raises(ConfigError) as exc:
        choose_resident(synthetic(1000), gpu, "on")
    assert str(exc.value) == ("device-resident data needs 0.01 GiB but cuda:0 has 0.00 GiB free "
                              "(at most 90% of it can hold data); use --device-data off (the "
                              "CPU loader) or a smaller dataset")


def test_resident_data_checks_its_tensors():
    with pytest.raises(ConfigError, match="same first dimension"):
        ResidentData([torch.zeros(3), torch.zeros(4)])


def test_evaluate_from_resident_data_equals_the_dataloader_path():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    ds = digits(train=False)
    a = ddpkit.evaluate(model, ds, batch_size=50, resident=False)
    b = ddpkit.evaluate(model, ds, batch_size=50, resident=True)
    assert a == b and a["count"] == len(ds)


@pytest.mark.slow
def test_train_job_with_device_data_on_cpu_is_bitwise_the_cpu_loader(tmp_path):
    cfg = TrainConfig(nproc=1, epochs=2, progress=False, ckpt_every_epoch=False)
    a = train(dataclasses.replace(cfg, device_data="off", output=str(tmp_path / "a")))
    b = train(dataclasses.replace(cfg, device_data="on", output=str(tmp_path / "b")))
    drop = ("train/samples_per_s", "train/step_ms", "train/epoch_s")
    strip = [{k: v for k, v in h.items() if k not in drop} for h in a.history]
    assert strip == [{k: v for k, v in h.items() if k not in drop} for h in b.history]
