"""Byte-level text for the language-model job (``ddpkit train --model gpt --data text``).

Every file under a directory (or, by default, ddpkit's own Python sources: text that is present
wherever ddpkit is installed, no download) is read as bytes and concatenated; the first 90% is the
training split, the rest validation. Items are non-overlapping windows of ``context + 1`` bytes:
``(inputs, targets)`` with the targets one byte ahead, so the vocabulary is the 256 byte values.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import Dataset

from ..base.errors import ConfigError
from ..data.resident import ResidentData

__all__ = ["TextBytes", "text", "TEXT_EXTENSIONS", "default_corpus"]

PathLike = Union[str, "os.PathLike[str]"]
TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".json", ".csv", ".tex", ".html", ".xml")
_PACKAGE = Path(__file__).resolve().parent.parent


def default_corpus() -> List[Path]:
    """ddpkit's own ``.py`` files, sorted: the text every installation has.

    Example::

        len(default_corpus())   # about 70 files
    """
    return sorted(p for p in _PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _files(root: Optional[PathLike]) -> List[Path]:
    if root is None:
        return default_corpus()
    base = Path(root).expanduser()
    if base.is_file():
        return [base]
    if not base.is_dir():
        raise ConfigError(f"--data-dir {root} does not exist; give a text file or a directory "
                          "of text files (nothing is downloaded)")
    found = sorted(p for p in base.rglob("*") if p.is_file() and p.suffix.lower() in
                   TEXT_EXTENSIONS)
    if not found:
        raise ConfigError(f"no text files under {root} (looked for "
                          f"{', '.join(TEXT_EXTENSIONS)})")
    return found


class _Windows:
    """Batch function on a device: each index i is the window [i*c, i*c + c] of the bytes."""

    def __init__(self, context: int) -> None:
        self.context = context

    def __call__(self, tensors: Sequence[torch.Tensor], index: torch.Tensor, epoch: int,
                 seed: int) -> list:
        (data,) = tensors
        offsets = torch.arange(self.context + 1, device=data.device)
        window = data[(index * self.context).unsqueeze(1) + offsets].long()
        return [window[:, :-1], window[:, 1:]]


class TextBytes(Dataset):
    """Windows of ``context`` input bytes and the ``context`` bytes one step ahead.

    Example::

        ds = TextBytes(torch.tensor(list(b"hello world, hello ddpkit"), dtype=torch.uint8), 8)
        x, y = ds[0]   # x = b"hello wo", y = b"ello wor" as int64
    """

    num_classes = 256   # the vocabulary: byte values
    in_channels = 1     # (unused: tokens have no channels)

    def __init__(self, data: torch.Tensor, context: int) -> None:
        if context < 1:
            raise ConfigError(f"text context must be >= 1, got {context}")
        self.data, self.context = data.to(torch.uint8), int(context)
        self.windows = (len(self.data) - 1) // self.context

    @property
    def model_options(self) -> Dict[str, Any]:
        """What the built-in language model needs to know about the data."""
        return {"context": self.context}

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.windows:
            raise IndexError(f"window {index} out of range for {self.windows}")
        w = self.data[index * self.context:(index + 1) * self.context + 1].long()
        return w[:-1], w[1:]

    def resident_nbytes(self) -> int:
        """The bytes themselves (windows are gathered on the device)."""
        return len(self.data)

    def resident(self, device: torch.device) -> ResidentData:
        """The bytes on ``device``; a batch is one gather of its windows there.

        Example::

            data = ds.resident(torch.device("cuda", 0))
        """
        return ResidentData([self.data.to(device)], _Windows(self.context), length=self.windows)

    def __repr__(self) -> str:
        return f"TextBytes({len(self.data)} bytes, {self.windows} windows of {self.context})"


def text(root: Optional[PathLike] = None, train: bool = True, context: int = 128,
         train_fraction: float = 0.9) -> TextBytes:
    """Byte-level text from the files under ``root`` (default: ddpkit's own sources).

    Example::

        train, val = text(train=True), text(train=False)
        train, val = text("~/corpus", train=True), text("~/corpus", train=False)
    """
    if not 0.0 < train_fraction < 1.0:
        raise ConfigError(f"train_fraction must be between 0 and 1, got {train_fraction}")
    raw = b"\n".join(p.read_bytes() for p in _files(root))
    cut = int(len(raw) * train_fraction)
    part = raw[:cut] if train else raw[cut:]
    if len(part) < context + 1:
        where = "the default corpus" if root is None else str(root)
        raise ConfigError(f"{where} has {len(part)} bytes in its {'training' if train else 'validation'} "
                          f"split, fewer than one window of {context + 1}; give more text or a "
                          "smaller context")
    return TextBytes(torch.frombuffer(bytearray(part), dtype=torch.uint8), context)
