"""Datasets that never download: sklearn digits, CIFAR-10/100 files, image folders, synthetic.

Items are ``(float32 CxHxW, int label)``; datasets expose num_classes, in_channels, image_size.
"""
from __future__ import annotations

import functools
import inspect
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .errors import ConfigError

__all__ = ["ImageDataset", "InMemoryImages", "ImageFolderDataset", "SyntheticImages",
           "random_crop_flip", "digits", "cifar", "image_folder", "synthetic",
           "DATASETS", "available_datasets", "build_dataset",
           "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR100_MEAN", "CIFAR100_STD",
           "IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_EXTENSIONS"]

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


# --------------------------------------------------------------------------------------------
# digits


@functools.lru_cache(maxsize=1)
def _load_digits() -> Tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as (N, 1, 8, 8) floats in [0, 1] and int64 labels; cached per process."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("dataset 'digits' needs scikit-learn; "
                          "pip install 'ddpkit[data]'") from None
    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0  # pixels are 0..16
    return x, torch.tensor(bunch.target, dtype=torch.int64)


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


def _require_pil() -> None:
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
    _require_pil()
    if image_size < 1:
        raise ConfigError(f"image_size must be a positive number of pixels, got {image_size}")
    root = Path(root).expanduser()
    class_dir, split_dir = _split_dirs(root, train)
    classes = _subdirs(class_dir)
    if not classes:
        raise ConfigError(f"no class folders in {class_dir}; {_FOLDER_LAYOUT}")
    return ImageFolderDataset(_scan_images(split_dir, classes), classes, image_size, augment,
                              normalize)


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
DATASETS: Dict[str, Callable[..., ImageDataset]] = {
    "digits": digits,
    "cifar10": functools.partial(cifar, num_classes=10),
    "cifar100": functools.partial(cifar, num_classes=100),
    "imagefolder": image_folder,
    "synthetic": synthetic,
}

_NEEDS_ROOT = {"cifar10": "PATH/cifar-10-batches-py/", "cifar100": "PATH/cifar-100-python/",
               "imagefolder": "PATH/train/<class>/*.png and PATH/val/<class>/*.png"}


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
    key = name.strip().lower().replace("-", "").replace("_", "")  # "CIFAR-10", "image_folder"
    if key not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; valid datasets: "
                          f"{', '.join(available_datasets())}")
    builder = DATASETS[key]
    unknown = sorted(set(kw) - set(_options(builder)))
    if unknown:
        raise ConfigError(f"dataset {key!r} has no option {', '.join(unknown)}; its options: "
                          f"{', '.join(_options(builder)) or 'none'}")
    if key not in _NEEDS_ROOT:
        return builder(train=train, **kw)
    if root is None:
        raise ConfigError(f"dataset {key!r} is read from disk; pass --data-dir PATH "
                          f"(expected {_NEEDS_ROOT[key]})")
    return builder(root, train=train, **kw)
