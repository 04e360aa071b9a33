"""Datasets that never download: the embedded digits, synthetic images, and by name
(``build_dataset``) the on-disk CIFAR-10/100 and image folders of :mod:`.disk_datasets`.

Items are ``(float32 CxHxW, int label)``; datasets expose num_classes, in_channels, image_size.
"""
from __future__ import annotations

import functools
import gzip
import inspect
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .disk_datasets import ImageFolderDataset, cifar, image_folder
from .text import TextBytes, text
from ..base.errors import ConfigError
from ..data.resident import ResidentData
from .images import (CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD, IMAGE_EXTENSIONS,
                     IMAGENET_MEAN, IMAGENET_STD, ImageDataset, InMemoryImages, random_crop_flip)

__all__ = ["ImageDataset", "InMemoryImages", "ImageFolderDataset", "SyntheticImages", "TextBytes",
           "random_crop_flip", "digits", "cifar", "image_folder", "synthetic", "text",
           "DATASETS", "available_datasets", "build_dataset",
           "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR100_MEAN", "CIFAR100_STD",
           "IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_EXTENSIONS"]


PathLike = Union[str, "os.PathLike[str]"]
_DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


# --------------------------------------------------------------------------------------------
# digits


@functools.lru_cache(maxsize=1)
def _load_digits() -> Tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as (N, 1, 8, 8) floats in [0, 1] and int64 labels; cached per process.

    Read from the copy shipped inside ddpkit (``job/data/digits.csv.gz``, the file scikit-learn
    ships), so the main job needs no extra package and no download."""
    with gzip.open(_DIGITS, "rt") as f:
        rows = [[int(v) for v in line.split(",")] for line in f if line.strip()]
    table = torch.tensor(rows, dtype=torch.int64)
    x = table[:, :64].to(torch.float32).view(-1, 1, 8, 8) / 16.0  # pixels are 0..16
    return x, table[:, 64].clone()


def _stratified_split(labels: torch.Tensor, test_fraction: float,
                      seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-class seeded shuffle; its own generator so the global RNG neither matters nor moves."""
    gen = torch.Generator().manual_seed(seed)
    train, test = [], []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        n_test = int(round(len(idx) * test_fraction))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return torch.sort(torch.cat(train)).values, torch.sort(torch.cat(test)).values


def digits(train: bool = True, test_fraction: float = 0.2, split_seed: int = 0) -> InMemoryImages:
    """scikit-learn's 1,797 8x8 handwritten digits (offline): 1x8x8 images, 10 classes.

    The split is stratified and depends only on ``split_seed``; both splits are normalized
    with the train split's mean and std.

    Example::

        train, test = digits(train=True), digits(train=False)   # 1438 + 359 items
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction}")
    x, y = _load_digits()
    train_idx, test_idx = _stratified_split(y, test_fraction, split_seed)
    mean, std = float(x[train_idx].mean()), float(x[train_idx].std())
    idx = train_idx if train else test_idx
    return InMemoryImages(x[idx], y[idx], 10, mean=(mean,), std=(std,), indices=idx)


# --------------------------------------------------------------------------------------------
# synthetic

_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): nearby inputs give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & _MASK64
    return h >> 1


class SyntheticImages(ImageDataset):
    """Standard-normal images and uniform labels, regenerated per item from (seed, split, index).

    Nothing is stored, so every rank sees identical data at any size for free.

    Example::

        ds = SyntheticImages(1000, (3, 32, 32), num_classes=100, seed=0)
        x, y = ds[7]   # same tensor on every call, process and rank
    """

    def __init__(self, num_samples: int, shape: Sequence[int] = (3, 32, 32),
                 num_classes: int = 100, seed: int = 0, train: bool = True) -> None:
        super().__init__(shape, num_classes)
        self.num_samples = num_samples
        self.seed = seed
        self.train = train

    def __len__(self) -> int:
        return self.num_samples

    def resident_nbytes(self) -> int:
        """Bytes of the whole set on a device: float32 images and int64 labels."""
        c, h, w = self.shape
        return self.num_samples * (4 * c * h * w + 8)

    def resident(self, device: torch.device) -> ResidentData:
        """The whole set generated on ``device`` from (seed, split) by that device's generator
        (so its values differ from the per-item CPU stream, as CUDA's generator differs from
        the CPU's; the same on every rank and every run).

        Example::

            data = synthetic(50_000).resident(torch.device("cuda", 0))
        """
        gen = torch.Generator(device=device).manual_seed(_mix(self.seed, int(self.train)))
        x = torch.randn((self.num_samples, *self.shape), generator=gen, device=device)
        y = torch.randint(self.num_classes, (self.num_samples,), generator=gen, device=device)
        return ResidentData([x, y])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        gen = torch.Generator().manual_seed(_mix(self.seed, int(self.train), index))
        x = torch.randn(self.shape, generator=gen)
        return x, int(torch.randint(self.num_classes, (), generator=gen))


def synthetic(num_samples: Optional[int] = None, shape: Sequence[int] = (3, 32, 32),
              num_classes: int = 100, seed: int = 0, train: bool = True) -> SyntheticImages:
    """Deterministic random data for benchmarks: no files, no memory, identical on all ranks.

    ``num_samples`` defaults to 10,000 for train and 2,000 for test; the test split draws
    from a different stream than the train split.

    Example::

        ds = synthetic(50_000, shape=(3, 32, 32), num_classes=100)
    """
    if num_samples is None:
        num_samples = 10_000 if train else 2_000
    if num_samples < 1 or num_classes < 1:
        raise ConfigError(f"synthetic data needs num_samples >= 1 and num_classes >= 1, "
                          f"got {num_samples} and {num_classes}")
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"synthetic shape must be (channels, height, width), got {tuple(shape)}")
    return SyntheticImages(num_samples, shape, num_classes, seed, train)


# --------------------------------------------------------------------------------------------
# registry

#: Dataset builders by name. Those in ``_NEEDS_ROOT`` take ``root`` first; all take ``train=``.
#:
#: Example::
#:
#:     ds = DATASETS["cifar10"]("~/data", train=False)
DATASETS: Dict[str, Callable[..., Any]] = {
    "digits": digits,
    "cifar10": functools.partial(cifar, num_classes=10),
    "cifar100": functools.partial(cifar, num_classes=100),
    "imagefolder": image_folder,
    "synthetic": synthetic,
    "text": text,
}

_NEEDS_ROOT = {"cifar10": "PATH/cifar-10-batches-py/", "cifar100": "PATH/cifar-100-python/",
               "imagefolder": "PATH/train/<class>/*.png and PATH/val/<class>/*.png"}


#: Datasets read from --data-dir (nothing is downloaded).
ON_DISK = ("cifar10", "cifar100", "imagefolder")


def dataset_key(name: str) -> str:
    """The canonical spelling of a dataset name: ``"CIFAR-10"`` -> ``"cifar10"``.

    Example::

        dataset_key("image_folder")   # 'imagefolder'
    """
    return name.strip().lower().replace("-", "").replace("_", "")


def available_datasets() -> List[str]:
    """Names accepted by :func:`build_dataset`.

    Example::

        available_datasets()   # ['cifar10', 'cifar100', 'digits', 'imagefolder', 'synthetic']
    """
    return sorted(DATASETS)


def _options(builder: Callable[..., Any]) -> List[str]:
    """Keyword options a builder takes besides root/train (and what a partial already fixed)."""
    fixed = set(getattr(builder, "keywords", {}) or {}) | {"root", "train"}
    params = inspect.signature(builder).parameters.values()
    return sorted(p.name for p in params if p.name not in fixed
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def build_dataset(name: str, root: Optional[PathLike] = None, train: bool = True,
                  **kw: Any) -> ImageDataset:
    """A dataset by name; ``root`` is required for the on-disk ones and ignored otherwise.

    Example::

        build_dataset("digits", train=False)
        build_dataset("cifar10", root="~/data", train=True, augment=True)
        build_dataset("synthetic", num_samples=1024, num_classes=10)
    """
    key = dataset_key(name)
    if key not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; valid datasets: "
                          f"{', '.join(available_datasets())}")
    builder = DATASETS[key]
    unknown = sorted(set(kw) - set(_options(builder)))
    if unknown:
        raise ConfigError(f"dataset {key!r} has no option {', '.join(unknown)}; its options: "
                          f"{', '.join(_options(builder)) or 'none'}")
    if key == "text":  # a directory of text, or ddpkit's own sources
        return builder(root, train=train, **kw)
    if key not in _NEEDS_ROOT:
        return builder(train=train, **kw)
    if root is None:
        raise ConfigError(f"dataset {key!r} is read from disk; pass --data-dir PATH "
                          f"(expected {_NEEDS_ROOT[key]})")
    return builder(root, train=train, **kw)
