"""The common shape of ddpkit's datasets: ``ImageDataset`` metadata, in-memory images, augmentation.

Items are ``(float32 CxHxW, int label)``; datasets expose num_classes, in_channels, image_size.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..data.resident import ResidentData

__all__ = ["ImageDataset", "InMemoryImages", "random_crop_flip", "batch_crop_flip",
           "crop_flip_draws", "CIFAR10_MEAN", "CIFAR10_STD",
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

    Draws from torch's global RNG on purpose, as torchvision's transforms do: in loader workers
    ddpkit seeds it per batch (run seed, epoch, batch), in the main process a resume restores
    it, so augmentation differs across samples yet replays exactly on resume.

    Example::

        x = random_crop_flip(torch.rand(3, 32, 32), padding=4)   # still (3, 32, 32)
    """
    _, h, w = image.shape
    padded = F.pad(image, (padding, padding, padding, padding))
    top = int(torch.randint(0, 2 * padding + 1, ()))
    left = int(torch.randint(0, 2 * padding + 1, ()))
    out = padded[:, top:top + h, left:left + w]
    return out.flip(-1) if bool(torch.rand(()) < 0.5) else out


def batch_crop_flip(images: torch.Tensor, tops: torch.Tensor, lefts: torch.Tensor,
                    flips: torch.Tensor, padding: int) -> torch.Tensor:
    """:func:`random_crop_flip` for a whole batch at once, on the batch's device: zero padding,
    then the crop at ``(tops[i], lefts[i])`` of the padded image ``i``, mirrored where
    ``flips[i]``. One gather, no Python loop over samples.

    Example::

        out = batch_crop_flip(x, tops, lefts, flips, padding=4)   # x: (B, C, H, W)
    """
    b, _c, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    rows = (tops.view(b, 1) + torch.arange(h, device=images.device)).view(b, h, 1)
    cols = lefts.view(b, 1) + torch.arange(w, device=images.device)
    cols = torch.where(flips.view(b, 1), cols.flip(1), cols).view(b, 1, w)
    batch = torch.arange(b, device=images.device).view(b, 1, 1)
    return padded[batch, :, rows, cols].permute(0, 3, 1, 2).contiguous()


def crop_flip_draws(seed: int, epoch: int, n: int, padding: int) -> torch.Tensor:
    """Every sample's crop offsets and flip for one epoch, as an ``(n, 3)`` int64 tensor (top,
    left, flip), drawn from ``(seed, epoch)`` alone: the same on any device, world size and
    resume position.

    Example::

        draws = crop_flip_draws(seed=0, epoch=3, n=50_000, padding=4)
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919 + 17) % 2**63)
    offsets = torch.randint(0, 2 * padding + 1, (n, 2), generator=gen)
    flips = (torch.rand(n, generator=gen) < 0.5).to(torch.int64).view(n, 1)
    return torch.cat([offsets, flips], dim=1)


class _ImagesOnDevice:
    """Batch function of :class:`InMemoryImages` on a device: gather, scale, augment, normalize."""

    def __init__(self, mean: Optional[torch.Tensor], std: Optional[torch.Tensor],
                 augment: bool, padding: int, device: torch.device) -> None:
        self.mean = None if mean is None else mean.to(device)
        self.std = None if std is None else std.to(device)
        self.augment, self.padding = augment, padding
        self._draws: Optional[Tuple[int, int, torch.Tensor]] = None  # (seed, epoch, draws)

    def _epoch_draws(self, n: int, epoch: int, seed: int, device: torch.device) -> torch.Tensor:
        if self._draws is None or self._draws[:2] != (seed, epoch):
            self._draws = (seed, epoch, crop_flip_draws(seed, epoch, n, self.padding).to(device))
        return self._draws[2]

    def __call__(self, tensors: Sequence[torch.Tensor], index: torch.Tensor, epoch: int,
                 seed: int) -> list:
        images, labels = tensors
        x = images.index_select(0, index)
        x = x.float().div(255) if x.dtype == torch.uint8 else x.float()
        if self.augment:
            d = self._epoch_draws(len(images), epoch, seed, x.device).index_select(0, index)
            x = batch_crop_flip(x, d[:, 0], d[:, 1], d[:, 2].bool(), self.padding)
        if self.mean is not None and self.std is not None:
            x = (x - self.mean) / self.std
        return [x, labels.index_select(0, index)]


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

    @property
    def padding(self) -> int:
        """Zero padding of the random crop (an eighth of the image: 4 px at 32x32)."""
        return max(1, self.shape[-1] // 8)

    def resident_nbytes(self) -> int:
        """Bytes on the device: images as stored (uint8 stays uint8) and int64 labels."""
        return self.images.numel() * self.images.element_size() + 8 * len(self.labels)

    def resident(self, device: torch.device) -> ResidentData:
        """The images and labels on ``device``; batches are scaled, augmented (crop + flip drawn
        per sample from the loader's seed and the epoch) and normalized there.

        Example::

            data = ds.resident(torch.device("cuda", 0))
        """
        return ResidentData([self.images.to(device), self.labels.to(device)],
                            _ImagesOnDevice(self.mean, self.std, self.augment, self.padding,
                                            device))

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        x = self.images[index]
        x = x.float().div(255) if x.dtype == torch.uint8 else x.float().clone()
        if self.augment:
            x = random_crop_flip(x, padding=self.padding)
        if self.mean is not None and self.std is not None:
            x = (x - self.mean) / self.std
        return x, int(self.labels[index])
