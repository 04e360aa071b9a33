"""Device-resident data: a dataset held on the rank's device, each batch one gather there.

The per-item ``Dataset`` + collate path costs CPU time per sample and a host-to-device copy per
batch; for datasets that fit in device memory (digits, CIFAR, synthetic images, any
``TensorDataset``) that leaves a fast GPU mostly idle. Here the data is moved (or generated) on
the device once; every pass takes this rank's indices from the same
:class:`~ddpkit.data.loader.ResumableSampler` as the ordinary loader (same ``set_epoch``, same resume
position, same shards), copies them to the device once per pass, and gathers each batch there.
Augmentation runs batched on the device (see :class:`ResidentData`).

A dataset takes part by being a ``TensorDataset`` or by offering two methods::

    def resident_nbytes(self) -> int: ...                       # bytes it will take on the device
    def resident(self, device) -> ResidentData: ...             # its tensors there + batch function

Everything here also runs with ``device="cpu"``, which is how CI tests it.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import torch
from torch.utils.data import TensorDataset

from ..base.errors import ConfigError

__all__ = ["ResidentData", "supports_resident", "resident_nbytes", "free_device_bytes",
           "choose_resident", "resident_batches", "batches_in", "describe", "RESIDENT_SHARE"]

#: ``resident="auto"`` puts the data on the device when it needs at most this share of the
#: device's free memory (the model, activations and optimizer state need the rest).
RESIDENT_SHARE = 0.25

BatchFn = Callable[[Sequence[torch.Tensor], torch.Tensor, int, int], Any]


def _gather(tensors: Sequence[torch.Tensor], index: torch.Tensor, epoch: int, seed: int) -> list:
    return [t.index_select(0, index) for t in tensors]


class ResidentData:
    """A dataset's tensors on a device and the function that makes a batch from indices.

    ``length`` is the number of items when it is not the tensors' first dimension.
    ``batch_fn(tensors, index, epoch, seed)`` gets the device tensors, the batch's dataset
    indices (a device tensor), the epoch and the loader's seed; the default gathers each tensor
    (what ``TensorDataset`` + the default collate give). Randomness drawn from ``(seed, epoch,
    index)`` rather than a global stream makes augmentation independent of the world size and of
    where a run resumed.

    Example::

        data = ResidentData([images.to(dev), labels.to(dev)])
        x, y = data.batch(torch.tensor([3, 1], device=dev), epoch=0, seed=0)
    """

    def __init__(self, tensors: Sequence[torch.Tensor], batch_fn: Optional[BatchFn] = None,
                 length: Optional[int] = None) -> None:
        self.tensors = list(tensors)
        self.batch_fn: BatchFn = batch_fn or _gather
        lengths = {len(t) for t in self.tensors}
        if length is None and len(lengths) != 1:
            raise ConfigError(f"device-resident tensors must have the same first dimension, "
                              f"got {sorted(lengths)}")
        #: Items (a batch function may make several from one row: text windows do).
        self.length = length if length is not None else lengths.pop()
        self.device = self.tensors[0].device

    def batch(self, index: torch.Tensor, epoch: int, seed: int) -> Any:
        """The batch of dataset positions ``index`` (a tensor on :attr:`device`)."""
        return self.batch_fn(self.tensors, index, epoch, seed)

    def __len__(self) -> int:
        return self.length


def supports_resident(dataset: Any) -> bool:
    """Whether ``dataset`` can live on the device (a ``TensorDataset`` or one with ``resident``).

    Example::

        supports_resident(TensorDataset(torch.zeros(4, 2)))   # True
    """
    return isinstance(dataset, TensorDataset) or (
        callable(getattr(dataset, "resident", None))
        and callable(getattr(dataset, "resident_nbytes", None)))


def resident_nbytes(dataset: Any) -> int:
    """Bytes ``dataset`` takes once on the device.

    Example::

        resident_nbytes(TensorDataset(torch.zeros(4, 2)))   # 32
    """
    if isinstance(dataset, TensorDataset):
        return sum(t.numel() * t.element_size() for t in dataset.tensors)
    return int(dataset.resident_nbytes())


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Free memory of a CUDA ``device`` in bytes (None for the CPU: the data is in RAM already).

    Example::

        free_device_bytes(torch.device("cuda", 0))   # e.g. 84_000_000_000
    """
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def choose_resident(dataset: Any, device: Optional[torch.device],
                    mode: Union[str, bool, None] = "auto") -> Optional[ResidentData]:
    """The device-resident form of ``dataset`` if ``mode`` asks for it, else None.

    ``"auto"`` (default): on a CUDA device, when the dataset supports it and needs at most
    :data:`RESIDENT_SHARE` of the free device memory; never on the CPU (the ordinary loader is
    as fast there). ``True``/``"on"``: always (also on the CPU), or one clear error saying why
    not. ``False``/``"off"``: never.

    Example::

        data = choose_resident(train_set, torch.device("cuda", 0))   # None if it does not fit
    """
    mode = {True: "on", False: "off", None: "off"}.get(mode, mode)  # type: ignore[arg-type]
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"device-resident data must be auto, on or off, got {mode!r}")
    if mode == "off" or device is None:
        return None
    if not supports_resident(dataset):
        if mode == "on":
            raise ConfigError(f"device-resident data needs an in-memory dataset (a TensorDataset, "
                              f"digits, cifar10/100, synthetic); {type(dataset).__name__} reads "
                              "items one by one: use --device-data off")
        return None
    if mode == "auto" and device.type != "cuda":
        return None
    need, free = resident_nbytes(dataset), free_device_bytes(device)
    if free is not None:
        limit = free * (RESIDENT_SHARE if mode == "auto" else 0.9)
        if need > limit:
            if mode == "auto":
                return None
            raise ConfigError(f"device-resident data needs {_gib(need)} but {device} has "
                              f"{_gib(free)} free (at most 90% of it can hold data); use "
                              "--device-data off (the CPU loader) or a smaller dataset")
    data = dataset.resident(device) if not isinstance(dataset, TensorDataset) else \
        ResidentData([t.to(device) for t in dataset.tensors])
    if len(data) != len(dataset):
        raise ConfigError(f"{type(dataset).__name__}.resident() holds {len(data)} items but the "
                          f"dataset has {len(dataset)}")
    return data


def resident_batches(data: ResidentData, order: List[int], batch_size: int, drop_last: bool,
                     epoch: int, seed: int) -> Iterator[Any]:
    """Batches of ``data`` in ``order`` (dataset positions): one copy of the order to the device,
    then one gather per batch there.

    Example::

        for x, y in resident_batches(data, [4, 0, 2, 1], batch_size=2, drop_last=False,
                                     epoch=0, seed=0): ...
    """
    n = len(order) // batch_size * batch_size if drop_last else len(order)
    if n == 0:
        return
    index = torch.tensor(order[:n], dtype=torch.int64).to(data.device, non_blocking=True)
    for begin in range(0, n, batch_size):
        yield data.batch(index[begin:begin + batch_size], epoch, seed)


def batches_in(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches a pass over ``samples`` makes (the same rule as ``DataLoader``).

    Example::

        batches_in(10, 4, drop_last=False)   # 3
    """
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def describe(data: ResidentData) -> str:
    """One line saying what was put on the device, for the run's log.

    Example::

        describe(data)   # 'data on cuda:0: 50000 items, 0.14 GiB, batches gathered there'
    """
    size = sum(t.numel() * t.element_size() for t in data.tensors)
    return f"data on {data.device}: {len(data)} items, {_gib(size)}, batches gathered there"
