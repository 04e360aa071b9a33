"""Tests for ddpkit.job.datasets: digits split, CIFAR pickles, image folders, synthetic, registry.

CIFAR files and images are generated in tmp_path in the distributed format; nothing downloads.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit.job import datasets as ds_mod
from ddpkit.job.datasets import (CIFAR10_MEAN, CIFAR10_STD, IMAGENET_MEAN, IMAGENET_STD,
                             available_datasets, build_dataset, cifar, digits, image_folder,
                             random_crop_flip, synthetic)
from ddpkit.base.errors import ConfigError


def check_item(dataset, channels: int, size: int) -> None:
    x, y = dataset[0]
    assert x.dtype == torch.float32 and x.shape == (channels, size, size)
    assert isinstance(y, int) and 0 <= y < dataset.num_classes
    assert dataset.in_channels == channels and dataset.image_size == size


# ------------------------------------------------------------------------------ digits


def test_digits_items_and_metadata() -> None:
    train = digits(train=True)
    check_item(train, 1, 8)
    assert train.num_classes == 10 and len(train.classes) == 10
    xs = torch.stack([train[i][0] for i in range(len(train))])
    assert abs(xs.mean().item()) < 0.05 and abs(xs.std().item() - 1) < 0.05


def test_digits_split_is_complete_disjoint_and_stratified() -> None:
    train, test = digits(train=True), digits(train=False)
    assert len(train) + len(test) == 1797
    assert set(train.indices.tolist()).isdisjoint(test.indices.tolist())
    assert 340 < len(test) < 380
    assert set(test.labels.tolist()) == set(range(10))  # every class in the test split


def test_digits_split_is_deterministic_and_ignores_global_rng() -> None:
    torch.manual_seed(1)
    first = digits(train=False)
    torch.manual_seed(2)
    second = digits(train=False)
    assert torch.equal(first.indices, second.indices)
    assert torch.equal(first[0][0], second[0][0])
    assert not torch.equal(first.indices, digits(train=False, split_seed=1).indices)


def test_digits_test_fraction_changes_sizes_and_is_validated() -> None:
    assert len(digits(train=False, test_fraction=0.5)) in range(880, 920)
    with pytest.raises(ConfigError, match="test_fraction"):
        digits(test_fraction=1.0)


def test_digits_need_no_sklearn(monkeypatch) -> None:
    # The digits ship inside ddpkit (a bare `pip install ddpkit` runs the main job); they are
    # the very file scikit-learn ships, so the two agree exactly where sklearn is installed.
    ds_mod._load_digits.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    try:
        x, y = ds_mod._load_digits()
    finally:
        ds_mod._load_digits.cache_clear()
    assert x.shape == (1797, 1, 8, 8) and y.shape == (1797,)
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0 and y.unique().tolist() == list(range(10))
    monkeypatch.undo()
    bunch = pytest.importorskip("sklearn.datasets").load_digits()
    assert torch.equal(x, torch.tensor(bunch.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16)
    assert torch.equal(y, torch.tensor(bunch.target, dtype=torch.int64))


# ------------------------------------------------------------------------------ CIFAR


def dump(path: Path, obj: dict, protocol: int = 2) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)


def fake_batch(rng: np.random.Generator, n: int, label_key: bytes, classes: int) -> dict:
    return {b"batch_label": b"fake", label_key: rng.integers(0, classes, n).tolist(),
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [b"img%d.png" % i for i in range(n)]}


def make_cifar10(parent: Path, per_batch: int = 4, n_test: int = 3) -> Path:
    """cifar-10-batches-py/ with data_batch_1..5, test_batch and batches.meta, tiny."""
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        dump(folder / f"data_batch_{i}", fake_batch(rng, per_batch, b"labels", 10))
    dump(folder / "test_batch", fake_batch(rng, n_test, b"labels", 10))
    dump(folder / "batches.meta", {b"label_names": [b"c%d" % i for i in range(10)],
                                   b"num_vis": 3072})
    return folder


def make_cifar100(parent: Path) -> Path:
    folder = parent / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name, n in (("train", 6), ("test", 2)):
        batch = fake_batch(rng, n, b"fine_labels", 100)
        batch[b"coarse_labels"] = [0] * n
        dump(folder / name, batch)
    dump(folder / "meta", {b"fine_label_names": [b"f%d" % i for i in range(100)]})
    return folder


def read_batch(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def test_cifar10_round_trip_from_parent_dir(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    train, test = cifar(tmp_path, train=True), cifar(tmp_path, train=False)
    assert len(train) == 20 and len(test) == 3
    check_item(train, 3, 32)
    assert train.num_classes == 10 and train.classes[3] == "c3"
    expected = [label for i in range(1, 6)
                for label in read_batch(folder / f"data_batch_{i}")[b"labels"]]
    assert [train[i][1] for i in range(20)] == expected


def test_cifar10_pixels_are_channel_planes_normalized(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    raw = read_batch(folder / "test_batch")[b"data"][1]  # R plane, G plane, B plane, row-major
    x, _ = cifar(folder, train=False)[1]
    for c in range(3):
        plane = torch.tensor(raw[c * 1024:(c + 1) * 1024], dtype=torch.float32).view(32, 32)
        expected = (plane / 255 - CIFAR10_MEAN[c]) / CIFAR10_STD[c]
        assert torch.allclose(x[c], expected, atol=1e-5)


def test_cifar10_accepts_the_batches_dir_itself(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    direct, via_parent = cifar(folder, train=False), cifar(tmp_path, train=False)
    assert len(direct) == 3 and torch.equal(direct[2][0], via_parent[2][0])


def test_cifar100_round_trip_both_root_forms(tmp_path: Path) -> None:
    folder = make_cifar100(tmp_path)
    for root in (tmp_path, folder):
        train = build_dataset("cifar100", root=root, train=True)
        assert len(train) == 6 and len(build_dataset("cifar100", root=root, train=False)) == 2
        check_item(train, 3, 32)
        assert train.num_classes == 100 and train.classes[99] == "f99"
        assert [train[i][1] for i in range(6)] == read_batch(folder / "train")[b"fine_labels"]


def test_cifar_loads_python2_era_numpy_module_paths(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    blob = (folder / "test_batch").read_bytes()
    assert b"numpy._core.multiarray" in blob  # protocol 2 names the module in a text line
    (folder / "test_batch").write_bytes(blob.replace(b"numpy._core.multiarray",
                                                     b"numpy.core.multiarray"))
    assert len(cifar(tmp_path, train=False)) == 3


def python2_batch(images: np.ndarray, labels: list) -> bytes:
    """The bytes Python 2's cPickle (protocol 2) wrote for {'data': uint8 array, 'labels': [..]}.

    Python 3 cannot write this form (its bytes go through _codecs.encode), so it is spelled out.
    """
    n, width = images.shape
    raw = images.tobytes()
    return (b"\x80\x02}(U\x04data" b"cnumpy.core.multiarray\n_reconstruct\n" b"cnumpy\nndarray\n"
            b"K\x00\x85U\x01b\x87R" b"(K\x01M" + n.to_bytes(2, "little") + b"M"
            + width.to_bytes(2, "little") + b"\x86" b"cnumpy\ndtype\nU\x02u1K\x00K\x01\x87R"
            b"(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
            b"\x89T" + len(raw).to_bytes(4, "little") + raw + b"tb"
            b"U\x06labels](" + b"".join(b"K" + bytes([y]) for y in labels) + b"eu.")


def test_cifar_reads_genuine_python2_pickles(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    images = np.random.default_rng(5).integers(0, 256, (2, 3072), dtype=np.uint8)
    (folder / "test_batch").write_bytes(python2_batch(images, [7, 2]))
    test = cifar(tmp_path, train=False)
    assert [test[0][1], test[1][1]] == [7, 2]
    pixel = (images[1, 0] / 255 - CIFAR10_MEAN[0]) / CIFAR10_STD[0]  # R plane, top-left pixel
    assert abs(test[1][0][0, 0, 0].item() - pixel) < 1e-5


def test_cifar_accepts_str_keys_and_newer_protocols(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    batch = {k.decode(): v for k, v in read_batch(folder / "test_batch").items()}
    dump(folder / "test_batch", batch, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(cifar(tmp_path, train=False)) == 3


def test_cifar_refuses_pickles_that_would_run_code(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    dump(folder / "test_batch", {b"data": Evil(), b"labels": []})
    with pytest.raises(ConfigError, match="test_batch"):
        cifar(tmp_path, train=False)
    assert not marker.exists()


def test_cifar_missing_dir_names_path_and_layout(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as err:
        cifar(missing, train=True)
    message = str(err.value)
    assert str(missing) in message and "data_batch_1..5" in message and "test_batch" in message
    assert "never downloads" in message and "\n" not in message


def test_cifar10_requires_all_five_train_batches(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(ConfigError, match="data_batch_3") as err:
        cifar(tmp_path, train=True)
    assert str(folder) in str(err.value)


def test_cifar_hints_at_unextracted_archive(tmp_path: Path) -> None:
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"")
    with pytest.raises(ConfigError, match="tar xzf"):
        cifar(tmp_path)


def test_cifar_rejects_wrong_class_count_and_bad_data(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    with pytest.raises(ConfigError, match="10 or 100"):
        cifar(tmp_path, num_classes=20)
    dump(folder / "test_batch", {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
    with pytest.raises(ConfigError, match="3072"):
        cifar(tmp_path, train=False)
    dump(folder / "test_batch", {b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]})
    with pytest.raises(ConfigError, match="outside"):
        cifar(tmp_path, train=False)


def test_cifar_augment_uses_global_rng(tmp_path: Path) -> None:
    make_cifar10(tmp_path)
    train = cifar(tmp_path, train=True, augment=True)
    torch.manual_seed(0)
    first = [train[0][0] for _ in range(8)]
    torch.manual_seed(0)
    again = [train[0][0] for _ in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert any(not torch.equal(first[0], other) for other in first[1:])
    assert first[0].shape == (3, 32, 32)


def test_random_crop_flip_keeps_shape_and_content_when_unpadded() -> None:
    image = torch.arange(12.0).view(1, 3, 4)
    out = random_crop_flip(image, padding=0)
    assert torch.equal(out, image) or torch.equal(out, image.flip(-1))
    assert random_crop_flip(torch.rand(3, 8, 8), padding=2).shape == (3, 8, 8)


# ------------------------------------------------------------------------------ image folders

def pil():
    return pytest.importorskip("PIL.Image", reason="Pillow is not installed; imagefolder needs it")


def save_image(path: Path, color, size=(10, 12), mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pil().new(mode, size, color).save(path)


def make_folder(root: Path) -> None:
    """ImageNet layout: train/{cat,dog}/ with 2 images each, val/{cat,dog}/ with 1 each."""
    for split, count in (("train", 2), ("val", 1)):
        for cls, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            for i in range(count):
                save_image(root / split / cls / f"{i}.png", color)


def test_image_folder_imagenet_layout(tmp_path: Path) -> None:
    make_folder(tmp_path)
    train = image_folder(tmp_path, train=True, image_size=16)
    val = build_dataset("imagefolder", root=tmp_path, train=False, image_size=16)
    assert (len(train), len(val)) == (4, 2)
    assert train.classes == ["cat", "dog"] and train.num_classes == 2
    check_item(train, 3, 16)
    assert sorted(y for _, y in (val[i] for i in range(2))) == [0, 1]


def test_image_folder_pixels_resized_and_normalized(tmp_path: Path) -> None:
    make_folder(tmp_path)
    x, label = image_folder(tmp_path, train=False, image_size=8)[0]  # a red cat
    assert label == 0
    for c, value in enumerate((1.0, 0.0, 0.0)):
        expected = (value - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
        assert torch.allclose(x[c], torch.full((8, 8), expected), atol=1e-4)
    raw, _ = image_folder(tmp_path, train=False, image_size=8, normalize=False)[0]
    assert raw.min() >= 0 and raw.max() <= 1


def test_image_folder_flat_layout_serves_both_splits(tmp_path: Path) -> None:
    save_image(tmp_path / "a" / "x.png", 128, mode="L")  # grayscale still yields 3 channels
    save_image(tmp_path / "b" / "y.jpg", (0, 255, 0))
    for train in (True, False):
        dataset = image_folder(tmp_path, train=train, image_size=4)
        assert len(dataset) == 2 and dataset.classes == ["a", "b"]
        check_item(dataset, 3, 4)


def test_image_folder_missing_or_empty_dir_names_path(tmp_path: Path) -> None:
    pil()
    with pytest.raises(ConfigError) as err:
        image_folder(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(err.value) and "<class>" in str(err.value)
    with pytest.raises(ConfigError, match="no class folders"):
        image_folder(tmp_path)
    (tmp_path / "cat").mkdir()
    with pytest.raises(ConfigError, match="no images"):
        image_folder(tmp_path)


def test_image_folder_split_problems(tmp_path: Path) -> None:
    save_image(tmp_path / "train" / "cat" / "0.png", (1, 2, 3))
    with pytest.raises(ConfigError, match="val"):
        image_folder(tmp_path, train=False)
    save_image(tmp_path / "val" / "cow" / "0.png", (1, 2, 3))
    with pytest.raises(ConfigError, match="cow"):
        image_folder(tmp_path, train=False)


def test_image_folder_corrupt_image_is_a_clear_error(tmp_path: Path) -> None:
    save_image(tmp_path / "cat" / "good.png", (1, 2, 3))
    (tmp_path / "cat" / "bad.png").write_bytes(b"not a png")
    dataset = image_folder(tmp_path)
    with pytest.raises(ConfigError, match="bad.png"):
        [dataset[i] for i in range(len(dataset))]


def test_image_folder_without_pillow_says_pip_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ConfigError, match="pip install pillow"):
        image_folder(tmp_path)


# ------------------------------------------------------------------------------ synthetic


def test_synthetic_is_deterministic_per_index_and_split() -> None:
    a, b = synthetic(10, (3, 8, 8), num_classes=5), synthetic(10, (3, 8, 8), num_classes=5)
    check_item(a, 3, 8)
    assert len(a) == 10 and a.num_classes == 5
    assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(10))
    assert not torch.equal(a[0][0], a[1][0])
    assert not torch.equal(a[0][0], synthetic(10, (3, 8, 8), 5, seed=1)[0][0])
    assert not torch.equal(a[0][0], synthetic(10, (3, 8, 8), 5, train=False)[0][0])
    assert torch.equal(a[-1][0], a[9][0])
    with pytest.raises(IndexError):
        a[10]


def test_synthetic_does_not_touch_global_rng_and_covers_labels() -> None:
    state = torch.get_rng_state()
    data = synthetic(200, shape=(1, 2, 2), num_classes=4)
    labels = {data[i][1] for i in range(len(data))}
    assert labels == {0, 1, 2, 3}
    assert torch.equal(state, torch.get_rng_state())


def test_synthetic_shapes_defaults_and_validation() -> None:
    assert synthetic(2, shape=(3, 4, 6)).image_size == (4, 6)
    assert len(synthetic()) == 10_000 and len(synthetic(train=False)) == 2_000
    with pytest.raises(ConfigError, match="shape"):
        synthetic(2, shape=(3, 4))
    with pytest.raises(ConfigError, match="num_samples"):
        synthetic(0)


# ------------------------------------------------------------------------------ registry


def test_available_datasets() -> None:
    assert available_datasets() == ["cifar10", "cifar100", "digits", "imagefolder", "synthetic",
                                    "text"]


def test_build_dataset_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as err:
        build_dataset("mnist")
    assert "mnist" in str(err.value)
    for name in available_datasets():
        assert name in str(err.value)


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "imagefolder"])
def test_build_dataset_on_disk_without_root_asks_for_data_dir(name: str) -> None:
    with pytest.raises(ConfigError, match="--data-dir PATH"):
        build_dataset(name)


def test_build_dataset_aliases_options_and_unknown_options(tmp_path: Path) -> None:
    make_cifar10(tmp_path)
    assert len(build_dataset("CIFAR-10", root=tmp_path, train=False)) == 3
    assert len(build_dataset("digits", root="ignored", train=False)) < 400
    data = build_dataset("synthetic", num_samples=3, num_classes=2, shape=(1, 4, 4))
    assert len(data) == 3 and data.num_classes == 2
    with pytest.raises(ConfigError, match="image_size"):
        build_dataset("digits", image_size=32)
    with pytest.raises(ConfigError, match="num_classes"):
        build_dataset("cifar10", root=tmp_path, num_classes=100)


def test_datasets_batch_through_a_dataloader_and_pickle(tmp_path: Path) -> None:
    make_cifar10(tmp_path)
    for dataset in (digits(train=False), cifar(tmp_path, augment=True),
                    synthetic(4, shape=(3, 8, 8))):
        x, y = next(iter(DataLoader(dataset, batch_size=2)))
        assert x.shape[0] == 2 and x.dtype == torch.float32 and y.dtype == torch.int64
        clone = pickle.loads(pickle.dumps(dataset))  # spawn-started workers pickle datasets
        assert len(clone) == len(dataset)
