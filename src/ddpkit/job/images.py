"""The common shape of ddpkit's datasets: ``ImageDataset`` metadata, in-memory images, augmentation.

Items are ``(float32 CxHxW, int label)``; datasets expose num_classes, in_channels, image_size.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["ImageDataset", "InMemoryImages", "random_crop_flip", "CIFAR10_MEAN", "CIFAR10_STD",
           "CIFAR100_MEAN", "CIFAR100_STD", "IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_EXTENSIONS"]

PathLike = Union[str, "os.PathLike[str]"]

# Per-channel statistics of the training splits (the values the literature normalizes with).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff")


class ImageDataset(Dataset):
    """Base class: the metadata a trainer needs to build a matching model.

    Example::

        ds = build_dataset("digits")
        model = build_model("small_cnn", ds.num_classes, ds.in_channels)
    """

    def __init__(self, shape: Sequence[int], num_classes: int,
                 classes: Optional[Sequence[str]] = None) -> None:
        self.shape: Tuple[int, int, int] = (int(shape[0]), int(shape[1]), int(shape[2]))
        self.num_classes = int(num_classes)
        self.classes: List[str] = list(classes) if classes else [str(i) for i in range(num_classes)]

    @property
    def in_channels(self) -> int:
        """Channels of every image (C of CxHxW)."""
        return self.shape[0]

    @property
    def image_size(self) -> Union[int, Tuple[int, int]]:
        """Side length of the (square) images; ``(H, W)`` only for non-square synthetic data."""
        h, w = self.shape[1:]
        return h if h == w else (h, w)

    def __len__(self) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(len={len(self)}, shape={self.shape}, "
                f"num_classes={self.num_classes})")


def random_crop_flip(image: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Random crop after zero padding, then a horizontal flip with probability 1/2.

    Draws from torch's global RNG on purpose: ddpkit seeds it per rank and per loader worker,
    so augmentation differs across workers yet replays exactly on resume.

    Example::

        x = random_crop_flip(torch.rand(3, 32, 32), padding=4)   # still (3, 32, 32)
    """
    _, h, w = image.shape
    padded = F.pad(image, (padding, padding, padding, padding))
    top = int(torch.randint(0, 2 * padding + 1, ()))
    left = int(torch.randint(0, 2 * padding + 1, ()))
    out = padded[:, top:top + h, left:left + w]
    return out.flip(-1) if bool(torch.rand(()) < 0.5) else out


def _channel_stats(values: Optional[Sequence[float]]) -> Optional[torch.Tensor]:
    return None if values is None else torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)


class InMemoryImages(ImageDataset):
    """Images held as one tensor (uint8 0..255 or float), normalized per item.

    uint8 storage keeps CIFAR at 150 MB per process instead of 600 MB of float32.

    Example::

        ds = InMemoryImages(torch.zeros(4, 3, 32, 32, dtype=torch.uint8), torch.arange(4), 10)
        x, y = ds[1]   # float32 (3, 32, 32), 1
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int, *,
                 mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 augment: bool = False, classes: Optional[Sequence[str]] = None,
                 indices: Optional[torch.Tensor] = None) -> None:
        super().__init__(images.shape[1:], num_classes, classes)
        self.images = images
        self.labels = labels.to(torch.int64)
        self.mean, self.std = _channel_stats(mean), _channel_stats(std)
        self.augment = augment
        #: Positions in the source data (digits: row of load_digits()), for split checks.
        self.indices = indices

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        x = self.images[index]
        x = x.float().div(255) if x.dtype == torch.uint8 else x.float().clone()
        if self.augment:
            x = random_crop_flip(x, padding=max(1, self.shape[-1] // 8))
        if self.mean is not None and self.std is not None:
            x = (x - self.mean) / self.std
        return x, int(self.labels[index])
