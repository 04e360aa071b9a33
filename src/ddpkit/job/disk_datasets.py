"""Datasets read from disk, never downloaded: CIFAR-10/100 (the python pickle batches) and image
folders (``<root>/train/<class>/*.png``). Both validate the layout and name what is missing.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..base.errors import ConfigError
from .images import (CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD, IMAGE_EXTENSIONS,
                     IMAGENET_MEAN, IMAGENET_STD, ImageDataset, InMemoryImages, _channel_stats,
                     random_crop_flip)

__all__ = ["cifar", "image_folder", "ImageFolderDataset"]

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------------------------
# CIFAR


class _CifarLayout(NamedTuple):
    dirname: str
    train: Tuple[str, ...]
    test: Tuple[str, ...]
    described: str
    meta: str
    label_key: str
    names_key: str
    tarball: str
    mean: Tuple[float, ...]
    std: Tuple[float, ...]


_CIFAR = {
    10: _CifarLayout("cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)),
                     ("test_batch",), "data_batch_1..5 and test_batch", "batches.meta",
                     "labels", "label_names", "cifar-10-python.tar.gz",
                     CIFAR10_MEAN, CIFAR10_STD),
    100: _CifarLayout("cifar-100-python", ("train",), ("test",), "train and test", "meta",
                      "fine_labels", "fine_label_names", "cifar-100-python.tar.gz",
                      CIFAR100_MEAN, CIFAR100_STD),
}

# A CIFAR batch holds a dict of bytes, lists and one numpy array; nothing else may be built.
_NUMPY_NAMES = {"_reconstruct", "ndarray", "dtype", "scalar", "_frombuffer"}


class _BatchUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global except those a numpy array needs (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode") or (
                module.split(".")[0] == "numpy" and name in _NUMPY_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _load_batch(path: Path) -> Dict[Any, Any]:
    """One pickled CIFAR dict; ``encoding='bytes'`` because the files were written by Python 2."""
    try:
        with open(path, "rb") as f:
            obj = _BatchUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError) as exc:
        raise ConfigError(f"{path} is not a CIFAR python batch ({exc}); "
                          "re-extract the CIFAR python version archive") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} is not a CIFAR python batch (holds a {type(obj).__name__}, "
                          "not a dict); re-extract the CIFAR python version archive")
    return obj


def _field(batch: Dict[Any, Any], key: str, path: Path) -> Any:
    """``batch[b'key']`` (as distributed) or ``batch['key']`` (files re-pickled by Python 3)."""
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise ConfigError(f"{path} has no {key!r} entry; is it a CIFAR python batch?")


def _cifar_dir(root: Path, layout: _CifarLayout) -> Path:
    """``root/<dirname>`` or ``root`` itself, checked to hold every batch file."""
    folder = root / layout.dirname if (root / layout.dirname).is_dir() else root
    expected = (f"expected {root / layout.dirname}/{layout.described} (CIFAR python version); "
                "ddpkit never downloads")
    if (root / layout.tarball).is_file():  # a common slip: downloaded but not extracted
        expected += f"; extract {root / layout.tarball} first (tar xzf)"
    if not root.is_dir():
        raise ConfigError(f"CIFAR directory {root} does not exist; {expected}")
    missing = [f for f in layout.train + layout.test if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"{folder} is missing {', '.join(missing)}; {expected}")
    return folder


def _cifar_classes(folder: Path, layout: _CifarLayout) -> Optional[List[str]]:
    """Class names from the optional meta file, else None (names are cosmetic)."""
    if not (folder / layout.meta).is_file():
        return None
    names = _field(_load_batch(folder / layout.meta), layout.names_key, folder / layout.meta)
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def _read_cifar_split(folder: Path, files: Sequence[str],
                      layout: _CifarLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """Concatenated (N, 3, 32, 32) uint8 images and int64 labels of the given batch files."""
    import numpy as np  # any CIFAR pickle holds numpy arrays, so numpy is there if we got here

    images, labels = [], []
    for name in files:
        batch = _load_batch(folder / name)
        data = np.asarray(_field(batch, "data", folder / name), dtype=np.uint8)
        targets = list(_field(batch, layout.label_key, folder / name))
        if data.ndim != 2 or data.shape[1] != 3072 or len(targets) != len(data):
            raise ConfigError(f"{folder / name} holds data of shape {data.shape} with "
                              f"{len(targets)} labels; expected N x 3072 uint8 and N labels")
        images.append(torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()))
        labels.extend(int(t) for t in targets)
    return torch.cat(images), torch.tensor(labels, dtype=torch.int64)


def cifar(root: PathLike, train: bool = True, num_classes: int = 10,
          augment: bool = False) -> InMemoryImages:
    """CIFAR-10 or CIFAR-100 from the python-pickle files exactly as distributed.

    ``root`` is the folder holding ``cifar-10-batches-py/`` (``cifar-100-python/``) or that
    folder itself. ``augment`` adds random crop (4 px padding) + horizontal flip.

    Example::

        train = cifar("~/data", train=True, num_classes=10, augment=True)   # 50,000 items
        test = cifar("~/data/cifar-10-batches-py", train=False)            # 10,000 items
    """
    if num_classes not in _CIFAR:
        raise ConfigError(f"CIFAR has 10 or 100 classes, not {num_classes}; "
                          "use cifar10 or cifar100")
    layout = _CIFAR[num_classes]
    folder = _cifar_dir(Path(root).expanduser(), layout)
    images, labels = _read_cifar_split(folder, layout.train if train else layout.test, layout)
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise ConfigError(f"labels in {folder} fall outside 0..{num_classes - 1}; "
                          f"is this really CIFAR-{num_classes}?")
    return InMemoryImages(images, labels, num_classes, mean=layout.mean, std=layout.std,
                          augment=augment, classes=_cifar_classes(folder, layout))


# --------------------------------------------------------------------------------------------
# image folders

_FOLDER_LAYOUT = ("expected <root>/train/<class>/*.png|jpg and <root>/val/<class>/*.png|jpg, "
                  "or <root>/<class>/*.png|jpg")


def require_pil() -> None:
    """Raise a one-line :class:`ConfigError` unless Pillow (needed to read images) imports.

    Example::

        require_pil()   # before scanning an image folder
    """
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        raise ConfigError("dataset 'imagefolder' needs Pillow to read images; "
                          "pip install pillow") from None


def _split_dirs(root: Path, train: bool) -> Tuple[Path, Path]:
    """(directory defining the classes, directory of the requested split)."""
    if not root.is_dir():
        raise ConfigError(f"image folder {root} does not exist; {_FOLDER_LAYOUT}")
    if not (root / "train").is_dir():  # flat layout: the same images serve both splits
        return root, root
    if train:
        return root / "train", root / "train"
    for name in ("val", "test"):
        if (root / name).is_dir():
            return root / "train", root / name
    raise ConfigError(f"{root} has train/ but no val/ (or test/) for evaluation; {_FOLDER_LAYOUT}")


def _subdirs(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _scan_images(split_dir: Path, classes: List[str]) -> List[Tuple[str, int]]:
    """(path, label) for every image below ``split_dir/<class>/``, in a stable order."""
    unknown = sorted(set(_subdirs(split_dir)) - set(classes))
    if unknown:
        raise ConfigError(f"{split_dir} has class folders {', '.join(unknown)} that the train "
                          "split lacks; the splits must share class names")
    samples = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        if folder.is_dir():
            files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS
                           and p.is_file() and not p.name.startswith("."))
            samples.extend((str(p), label) for p in files)
    if not samples:
        raise ConfigError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {split_dir}; "
                          f"{_FOLDER_LAYOUT}")
    return samples


def _load_image(path: str, size: int) -> torch.Tensor:
    """RGB float32 (3, size, size) in [0, 1]; PIL's resize antialiases when shrinking."""
    from PIL import Image

    bilinear = getattr(Image, "Resampling", Image).BILINEAR
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB").resize((size, size), bilinear)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read image {path} ({exc}); "
                          "remove or replace the file") from None
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(size, size, 3).permute(2, 0, 1).float().div(255)


class ImageFolderDataset(ImageDataset):
    """Images read from disk on access (class-per-folder), resized to a square.

    Example::

        ds = ImageFolderDataset([("a/cat/1.png", 0)], ["cat"], image_size=32)
        x, y = ds[0]   # float32 (3, 32, 32), 0
    """

    def __init__(self, samples: Sequence[Tuple[str, int]], classes: Sequence[str],
                 image_size: int = 32, augment: bool = False, normalize: bool = True) -> None:
        super().__init__((3, image_size, image_size), len(classes), classes)
        self.samples = list(samples)
        self.augment = augment
        self.mean = _channel_stats(IMAGENET_MEAN) if normalize else None
        self.std = _channel_stats(IMAGENET_STD) if normalize else None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        x = _load_image(path, self.shape[-1])
        if self.augment:
            x = random_crop_flip(x, padding=max(1, self.shape[-1] // 8))
        if self.mean is not None and self.std is not None:
            x = (x - self.mean) / self.std
        return x, label


def image_folder(root: PathLike, train: bool = True, image_size: int = 32, augment: bool = False,
                 normalize: bool = True) -> ImageFolderDataset:
    """Class-per-folder images (ImageNet layout ``root/train/<class>/``, ``root/val/<class>/``).

    Without ``root/train`` the class folders sit in ``root`` and serve both splits. Classes
    are the sorted train folder names; images are normalized with ImageNet statistics.

    Example::

        train = image_folder("~/data/imagenette", train=True, image_size=64, augment=True)
    """
    require_pil()
    if image_size < 1:
        raise ConfigError(f"image_size must be a positive number of pixels, got {image_size}")
    root = Path(root).expanduser()
    class_dir, split_dir = _split_dirs(root, train)
    classes = _subdirs(class_dir)
    if not classes:
        raise ConfigError(f"no class folders in {class_dir}; {_FOLDER_LAYOUT}")
    return ImageFolderDataset(_scan_images(split_dir, classes), classes, image_size, augment,
                              normalize)
