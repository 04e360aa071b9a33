"""Sharded checkpoints for FSDP models: every rank writes its shard of the model and optimizer with
``torch.distributed.checkpoint`` (DCP), and a run of any size reads them back (resharding).

A sharded checkpoint is the usual ``ckpt-{step}.pt`` (loop position, schedule, RNG, ...: written
atomically by rank 0 *after* the shards) plus the directory ``ckpt-{step}.shards/``, written under
a temporary name and renamed only when every rank has finished: a checkpoint is visible only
when complete. :func:`consolidate` turns one into a plain ``state_dict`` file for inference.

Example::

    name = save_shards(model, optimizer, Path("runs/x/checkpoints"), step=120)
    load_shards(model, optimizer, Path("runs/x/checkpoints/ckpt-000000120.shards"))
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Union

import torch
from torch import nn

from ..engines import comm
from .names import list_checkpoints
from .write import SaveError, disk_full, no_space, state_bytes
from ..base.errors import ConfigError

__all__ = ["is_sharded", "shards_name", "save_shards", "start_shards", "async_group",
           "async_writer", "load_shards",
           "load_full_state", "remove_shards", "consolidate"]

PathLike = Union[str, "os.PathLike[str]"]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module (its parameters are shards).

    Example::

        is_sharded(rt.wrap(net))   # True under the fsdp engine on 2+ ranks
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: no FSDP2
        return False
    return isinstance(model, FSDPModule)


def shards_name(step: int) -> str:
    """The shard directory's name next to ``ckpt-{step}.pt``.

    Example::

        shards_name(120)   # 'ckpt-000000120.shards'
    """
    return f"ckpt-{step:09d}.shards"


def save_shards(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], directory: Path,
                step: int) -> str:
    """Write this rank's shards of ``model`` and ``optimizer`` (call on every rank); returns the
    shard directory's name. Complete or absent: written to a temporary name, renamed by rank 0
    once every rank is done.

    Example::

        save_shards(model, opt, Path("ckpt"), step)
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    name, final, tmp, state = _begin(model, optimizer, directory, step)
    try:
        # Buffers (BatchNorm statistics) are plain tensors every rank holds its own copy of;
        # DCP keeps one copy of each from whichever rank writes least, a mix of ranks. Rank 0's,
        # as in a DDP checkpoint and as ddpkit.evaluate scores them.
        dcp.save(state, storage_writer=_writer(tmp), planner=_rank0_planner(DefaultSavePlanner))
    except BaseException as exc:  # DCP's CheckpointException (a BaseException), on every rank
        _shards_failed(exc, directory, tmp, step, state_bytes(state))
        raise
    comm.barrier()
    if comm.is_main():
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    comm.barrier()
    return name


def start_shards(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], directory: Path,
                 step: int, group: Any, writer: Any) -> Tuple[str, Callable[[], None]]:
    """Begin writing this rank's shards in the background (call on every rank): returns the
    shard directory's name and ``complete()``, which waits for the write (any thread) and
    raises its failure; on rank 0 it then renames the finished directory into place.

    The step waits only while DCP copies the shards into host memory (``writer``: one
    :func:`async_writer` kept from save to save, whose copies are reused); the planning and
    writing run in DCP's thread, their collectives on ``group`` (a gloo group of their own,
    so they never interleave with the training's). Rank 0's write ends only after every
    rank's data and the metadata are written, so its rename needs no barrier.

    Example::

        name, complete = start_shards(model, opt, Path("ckpt"), step, group, async_writer())
        ...                # training goes on
        complete()         # every rank; rank 0 then finds ckpt/<name> whole
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    name, final, tmp, state = _begin(model, optimizer, directory, step)
    future = dcp.async_save(state, checkpoint_id=str(tmp), storage_writer=writer,
                            planner=_rank0_planner(DefaultSavePlanner), process_group=group)

    def complete() -> None:
        try:
            future.result()
        except BaseException as exc:  # DCP's CheckpointException, on every rank
            _shards_failed(exc, directory, tmp, step, state_bytes(state))
            raise
        if comm.is_main():
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    return name, complete


def _begin(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], directory: Path,
           step: int) -> Tuple[str, Path, Path, Dict[str, Any]]:
    # Every rank: the shard directory's name, final and temporary paths (a torn one removed),
    # and the state DCP writes (this rank's shards).
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = shards_name(step)
    final, tmp = directory / name, directory / f".{name}.tmp"
    if comm.is_main():
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # torn by an earlier crash
    comm.barrier()
    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    return name, final, tmp, {"model": model_state, "optim": optim_state}


def async_group() -> Any:
    """A gloo group of every rank for DCP's background saves (None alone); every rank calls it.

    Example::

        group = async_group()
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(backend="gloo")


def async_writer() -> Any:
    """The DCP writer :func:`start_shards` takes: its host copies kept for the next save.

    Example::

        writer = async_writer()
    """
    return _writer(None, cache=True)


def _writer(path: Optional[Path], cache: bool = False) -> Any:
    """DCP's file writer (as ``dcp.save(checkpoint_id=path)`` makes it), raising the bare
    ``OSError`` of a full disk: DCP pickles each rank's error to share it, which drops the
    ``OSError`` that torch's zip writer wraps in its own ``RuntimeError``."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            with _bare_disk_full():
                return super().write_data(*args, **kwargs)

        def finish(self, *args: Any, **kwargs: Any) -> None:
            with _bare_disk_full():
                super().finish(*args, **kwargs)

    if not cache:
        return Writer(str(path))

    class Staging(Writer):
        # The copy async_save makes before it returns, into host tensors kept for the next
        # save (pinned on a GPU). DCP's own would pin on a CPU-only machine (an error) or,
        # uncached, hand CPU tensors over as they are: the thread would write live tensors
        # the next optimizer step is changing.
        host: Any = None  # the host copies, once a save made them

        def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
            from torch.distributed._state_dict_utils import (_copy_state_dict,
                                                             _create_cpu_state_dict)

            gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
            for attempt in (0, 1):
                if self.host is None:
                    self.host = _create_cpu_state_dict(state_dict, pin_memory=gpu)
                try:
                    staged = _copy_state_dict(state_dict, self.host, non_blocking=gpu)
                    break
                except (KeyError, ValueError, RuntimeError, AssertionError):
                    if attempt:  # not a changed layout (new optimizer state): a real error
                        raise
                    self.host = None
            if gpu:
                torch.cuda.synchronize()
            return staged

    return Staging("")  # each save's directory comes as its checkpoint_id


@contextlib.contextmanager
def _bare_disk_full() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        full = disk_full(exc)
        if full is None or full is exc:
            raise
        raise OSError(full.errno, full.strerror, full.filename) from None


def _shards_failed(exc: BaseException, directory: Path, tmp: Path, step: int,
                   size: int) -> None:
    # DCP gathers every rank's write errors and raises on every rank, so all of them are here:
    # rank 0 removes the partial shards; a full disk becomes one line (SaveError: rank 0 prints).
    if comm.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    full = disk_full(exc)
    if full is None:
        return
    found = list_checkpoints(directory)
    needed = size * comm.world_size()  # about: every rank holds a like shard
    raise SaveError(no_space(full, f"sharded checkpoint {directory / shards_name(step)}",
                             directory, needed, found[-1] if found else None)) from None


def load_shards(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], path: Path) -> None:
    """Load a shard directory into ``model`` / ``optimizer`` on every rank, whatever the number
    of ranks that wrote it (DCP reshards); works for FSDP, DDP and plain modules alike.

    Example::

        load_shards(model, opt, Path("ckpt/ckpt-000000120.shards"))
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (path / ".metadata").is_file():
        raise ConfigError(f"sharded checkpoint {path} is incomplete (no .metadata); it was not "
                          "written to the end: resume from an earlier checkpoint")
    opts = optimizer if optimizer is not None else []
    model_state, optim_state = get_state_dict(model, opts)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # (a BaseException): every rank's traceback
        lines = [line.strip() for line in str(exc).strip().splitlines()]
        why = next((line.split(": ", 1)[-1] for line in lines if line.startswith(
            ("ValueError", "RuntimeError", "KeyError"))), lines[0] if lines else type(exc).__name__)
        raise ConfigError(f"sharded checkpoint {path} does not fit this model ({why[:200]}); "
                          "resume with the model that wrote it") from None
    set_state_dict(model, opts, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_full_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                    model_state: Dict[str, Any], optim_state: Optional[Dict[str, Any]]) -> None:
    """Load a plain (DDP / one-process) checkpoint's state into a sharded model on every rank.

    The plain optimizer state is keyed by parameter position; it is re-keyed by parameter name
    (the order of ``model.named_parameters()``, which is how the optimizer was built).

    Example::

        load_full_state(fsdp_model, opt, ckpt["model"], ckpt["optimizer"])
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=full)
    if optimizer is None or not optim_state:
        return
    names = [n for n, _ in model.named_parameters()]
    by_position = dict(enumerate(names))
    renamed = {"state": {by_position[int(i)]: v for i, v in optim_state["state"].items()},
               "param_groups": [dict(g, params=[by_position[int(i)] for i in g["params"]])
                                for g in optim_state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, renamed, options=full)


def remove_shards(checkpoint: Path) -> None:
    """Delete the shard directory belonging to ``ckpt-{step}.pt`` (if any).

    Example::

        remove_shards(Path("ckpt/ckpt-000000120.pt"))
    """
    shards = checkpoint.with_suffix(".shards")
    if shards.is_dir():
        shutil.rmtree(shards, ignore_errors=True)


def consolidate(checkpoint: PathLike, out: PathLike) -> Path:
    """One plain ``state_dict`` file (the model alone, full tensors) from a sharded checkpoint,
    for inference or a DDP run: ``torch.load(out)`` gives what ``model.load_state_dict`` takes.
    Runs in one process, no process group.

    Example::

        consolidate("runs/x/checkpoints/ckpt-000000120.pt", "model.pt")
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(checkpoint).expanduser()
    shards = path if path.suffix == ".shards" else path.with_suffix(".shards")
    if not path.exists() and not shards.exists():
        raise ConfigError(f"{checkpoint} does not exist; give a sharded checkpoint's file "
                          "(runs/NAME/checkpoints/ckpt-*.pt, beside its .shards/ folder)")
    if not (shards / ".metadata").is_file():
        raise ConfigError(f"{checkpoint} is not a sharded checkpoint (no {shards.name}/ with "
                          "DCP metadata); plain checkpoints need no consolidation")
    out_path = Path(out).expanduser()
    tmp = out_path.with_name(out_path.name + ".all.tmp")
    dcp_to_torch_save(str(shards), str(tmp))
    everything = torch.load(tmp, map_location="cpu", weights_only=False)
    tmp.unlink()
    model = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in everything["model"].items()}
    torch.save(model, out_path)
    return out_path


def _rank0_planner(planner: Any) -> Any:
    """DCP's planner keeping replicated tensors from the lowest rank (torch >= 2.5 has the
    switch; before it, DCP's default)."""
    try:
        return planner(dedup_save_to_lowest_rank=True)
    except TypeError:
        return planner()
