"""What ``ddpkit plan`` measures: the user's job, not a stand-in: its model, a batch shaped as
the job's dataset makes it, the threads one rank of that job gets (``.calibrate`` times them),
and how it was measured, said in plan's output.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..cost.measure import Timing, Workload, workload_of
from ..base.errors import ConfigError

__all__ = ["JobInput", "Measured", "job_input", "parse_shape", "rank_threads", "using_threads",
           "job_batch", "job_model", "job_workload"]


@dataclass(frozen=True)
class JobInput:
    """One sample as the job feeds it to the model, and where that shape came from. Example::

        JobInput((1, 8, 8), 10, "the job's dataset digits")
    """

    shape: Tuple[int, ...]            # (C, H, W), or (tokens,) for a language model
    num_classes: int
    source: str                       # said in plan's output
    options: Dict[str, Any] = field(default_factory=dict)  # what the model needs of the data
    dataset: Any = field(default=None, compare=False, repr=False)  # real samples, when built

    def describe(self) -> str:
        what = f"{self.shape[0]} tokens" if len(self.shape) == 1 else \
            "x".join(str(s) for s in self.shape)
        return f"{what} from {self.source}"


@dataclass(frozen=True)
class Measured:
    """How plan's figures were measured, said with them. Example::

        Measured(job_input("small_cnn"), threads=1, device="cpu", ranks_per_node=2,
                 compute=Timing.of([0.0049, 0.0051, 0.0050]))
    """

    input: Optional[JobInput]         # None: a model known only by its parameter count
    threads: int
    device: str
    ranks_per_node: int
    compute: Optional[Timing] = None  # None: given by --compute-ms
    hooks: Dict[str, Timing] = field(default_factory=dict)
    host_ranks: int = 0               # ranks timed at once on this host (0: ranks_per_node)
    node: Optional[Timing] = None     # the node's whole step, its ranks' all-reduce included

    @property
    def ranks_timed(self) -> int:
        """The ranks that ran at once while the step was timed."""
        return self.host_ranks or self.ranks_per_node


def parse_shape(text: str) -> Tuple[int, ...]:
    """``--input-shape``: ``C,H,W`` of one image, or ``T``, a language model's tokens.

    Example::

        parse_shape("3,32,32"), parse_shape("256")   # (3, 32, 32), (256,)
    """
    try:
        shape = tuple(int(v) for v in text.replace("x", ",").split(",") if v.strip())
    except ValueError:
        shape = ()
    if len(shape) not in (1, 3) or min(shape) < 1:
        raise ConfigError(f"--input-shape {text!r}: give C,H,W of one image (e.g. 3,32,32) or "
                          "the tokens of one sequence (e.g. 128)")
    return shape


def job_input(model: str, data: Optional[str] = None, data_dir: Optional[str] = None,
              shape: Optional[Sequence[int]] = None) -> JobInput:
    """The input ``ddpkit train --model MODEL --data DATA`` feeds its model: the dataset's own
    (built as the job builds it: ``digits`` by default, ``text`` for a language model), or
    ``shape`` when given. Timing 3x32x32 images for the 8x8 digits of the default job predicted
    its step 20-50x too long.

    Example::

        job_input("small_cnn").shape                   # (1, 8, 8): the default job's digits
        job_input("resnet18", shape=(3, 32, 32)).shape # (3, 32, 32)
    """
    from ..job.config import TrainConfig
    from ..job.datasets import build_dataset, dataset_key
    from ..job.models import LANGUAGE_MODELS, is_torchvision, model_key

    text = not is_torchvision(model) and model_key(model) in LANGUAGE_MODELS
    data = data or ("text" if text else TrainConfig.data)
    if text or dataset_key(data) == "text":
        tokens = int(shape[0]) if shape else TrainConfig.context
        said = "--input-shape" if shape else f"the job's context ({tokens} bytes of --data text)"
        return JobInput((tokens,), 256, said, {"context": tokens})
    if shape is not None:
        if len(shape) != 3:
            raise ConfigError(f"--input-shape {','.join(map(str, shape))}: an image model takes "
                              "C,H,W")
        return JobInput(tuple(int(s) for s in shape), 10, "--input-shape")
    kw = {"num_samples": 256, "num_classes": 10} if dataset_key(data) == "synthetic" else {}
    try:
        dataset = build_dataset(data, data_dir, train=True, **kw)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (or give plan --input-shape C,H,W)") from None
    return JobInput(tuple(dataset.shape), dataset.num_classes, f"the job's dataset {data}",
                    dict(getattr(dataset, "model_options", {})), dataset)


def rank_threads(ranks_per_node: int, environ: Mapping[str, str] = os.environ,
                 cores: Optional[int] = None) -> int:
    """The intra-op threads one CPU rank of ``ddpkit train`` runs with: ``OMP_NUM_THREADS``
    when set, else the cores split between the node's ranks (as
    ``ddpkit.env.dist.cpu_threads_per_process``), torch's own choice for one rank alone. Timing with
    every thread where two ranks share the cores put the default job's compute anywhere in
    38-855 ms over six runs.

    Example::

        rank_threads(2, environ={}, cores=16)   # 8
    """
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    if ranks_per_node <= 1:
        return torch.get_num_threads()
    return max(1, (cores or os.cpu_count() or 1) // ranks_per_node)


@contextlib.contextmanager
def using_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside, put back after. Example::

        with using_threads(1): measure_workload("small_cnn", job_input("small_cnn"), 32)
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def job_batch(inp: JobInput, batch: int, device: torch.device
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """A batch of the job's own samples where its dataset was built; random ones of its shape
    otherwise (a dense model costs the same on any values).

    Example::

        x, y = job_batch(job_input("small_cnn"), 32, torch.device("cpu"))   # (32, 1, 8, 8)
    """
    gen = torch.Generator().manual_seed(0)
    if inp.dataset is not None and len(inp.dataset) > 0:
        items = [inp.dataset[i % len(inp.dataset)] for i in range(batch)]
        x = torch.stack([torch.as_tensor(item[0]) for item in items])
        y = torch.as_tensor([int(item[1]) for item in items])
    elif len(inp.shape) == 1:
        x = torch.randint(0, inp.num_classes, (batch, inp.shape[0]), generator=gen)
        y = torch.randint(0, inp.num_classes, (batch, inp.shape[0]), generator=gen)
    else:
        x = torch.randn((batch, *inp.shape), generator=gen)
        y = torch.randint(0, inp.num_classes, (batch,), generator=gen)
    return x.to(device), y.to(device)


def job_model(name: str, inp: JobInput) -> nn.Module:
    """A built-in model of ``ddpkit train`` (or ``torchvision:<name>``) built for ``inp``, as
    the job builds it (seeded: every rank the same).

    Example::

        job_model("small_cnn", job_input("small_cnn"))   # SmallCNN(in_channels=1, ...)
    """
    from ..job.models import build_model

    torch.manual_seed(0)
    return build_model(name, inp.num_classes, 1 if len(inp.shape) == 1 else inp.shape[0],
                       **inp.options)


def job_workload(name: str, inp: JobInput, batch: int, compute_s: float) -> Workload:
    """What ``name`` built for ``inp`` makes DDP carry (its buckets), with ``compute_s``.

    Example::

        job_workload("small_cnn", job_input("small_cnn"), batch=32, compute_s=0.004)
    """
    return workload_of(job_model(name, inp), compute_s, batch, name)
