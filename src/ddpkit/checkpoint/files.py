"""Checkpoint I/O: atomic saves on rank 0, keep-last-K pruning, safe loads, resume discovery.

Loads use ``weights_only`` (a checkpoint can never run code) and verify each record's CRC32.
"""
from __future__ import annotations

import contextlib
import pickle
import re
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..engines import comm
from .compat import check_compatible, check_optimizer_compatible
from .write import SaveError, atomic_write, disk_full, no_space, state_bytes
from ..base.errors import ConfigError, DDPKitError
from .names import _NAME, _step_of, checkpoint_name, list_checkpoints
from .pickles import code_named, refuse_unloadable, refused_line
from .sharded import remove_shards

__all__ = ["checkpoint_name", "save_checkpoint", "load_checkpoint", "list_checkpoints",
           "resume_order", "find_latest", "resolve_resume", "check_compatible",
           "check_optimizer_compatible", "checkpoint_metadata", "holds_run", "FORMAT_VERSION",
           "LATEST"]

PathLike = Union[str, Path]
Fits = Callable[[dict], Optional[str]]  # why a loaded checkpoint is not this run's, or None
FORMAT_VERSION = 1
LATEST = "latest"                        # pointer file holding the newest checkpoint's name
_TMP = re.compile(r"ckpt-(\d+)\.pt\.tmp")
_CHUNK = 1 << 24


# --------------------------------------------------------------------------- saving

def save_checkpoint(state: Dict[str, Any], directory: PathLike, step: int,
                    keep: int = 3) -> Optional[Path]:
    """Write ``state`` as ``directory/ckpt-{step:09d}.pt`` on rank 0; call it on EVERY rank.

    The write is atomic (temp file, fsync, rename), then the ``latest`` pointer is updated and
    checkpoints older than the newest ``keep`` are deleted. Only rank 0's arguments are used.
    If rank 0 fails, every rank raises :class:`DDPKitError` (none is left waiting); a full disk
    is one line (:class:`~ddpkit.checkpoint.write.SaveError`, printed by rank 0 alone): the size, the
    newest intact checkpoint and how to resume, with the partial file removed.
    Returns the new file's path on rank 0 and ``None`` on the other ranks.

    Example::

        save_checkpoint({"model": unwrap(model).state_dict(), "step": step}, "ckpt", step)
    """
    path: Optional[Path] = None
    error: Optional[str] = None
    raised: Optional[BaseException] = None
    if comm.is_main():
        try:
            path = _save_on_main(state, Path(directory).expanduser(), step, keep)
        except DDPKitError as exc:
            error, raised = str(exc), exc
        except Exception as exc:  # e.g. an unpicklable object: the other ranks must hear of it too
            error, raised = f"saving checkpoint step {step} failed on rank 0: {exc!r}", exc
    # Every rank reaches this collective, so a failure on rank 0 cannot strand the others.
    error = comm.broadcast_object(error)
    if error is not None:
        if raised is not None:
            raise raised
        raise SaveError(error)  # rank 0 reports it: the others leave quietly
    comm.barrier()
    return path


def _save_on_main(state: Dict[str, Any], directory: Path, step: int, keep: int) -> Path:
    _check_save_args(state, step, keep)
    final = directory / checkpoint_name(step)
    previous: Optional[Path] = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        previous = _newest(directory)
        # Room first: keep-K holds at most max(K, 2) files while the next is written (the
        # newest complete one always stays), so keeping fewer really takes less disk.
        _prune(directory, final, max(keep, 2))
        atomic_write(final, lambda f: torch.save(state, f),
                     verify=lambda tmp: refuse_unloadable(tmp, state))
        _point_to(final)
    except Exception as exc:  # torch's zip writer wraps a full disk's OSError in a RuntimeError
        full = disk_full(exc)
        if full is not None:
            newest = final if final.is_file() else previous  # the pointer failed, not the file
            needed = max(state_bytes(state), previous.stat().st_size if previous else 0)
            older = [p.stat().st_size for p in list_checkpoints(directory) if _step_of(p) < step]
            raise SaveError(no_space(full, f"checkpoint {final}", directory, needed, newest,
                                     keep, older)) from None
        if not isinstance(exc, OSError):
            raise
        kept = (f"the previous checkpoint {previous} is intact" if previous is not None
                else f"there is no earlier checkpoint in {directory}")
        raise DDPKitError(f"saving checkpoint {final} failed ({exc}); {kept}; fix the cause "
                          "(disk space, permissions) before the next save") from exc
    _prune(directory, final, keep)
    return final


def _point_to(final: Path) -> None:
    pointer = final.parent / LATEST
    try:
        atomic_write(pointer, lambda f: f.write(f"{final.name}\n".encode()))
    except OSError:
        # A stale pointer would send a resume to an older checkpoint than the one just written:
        # without it, resume scans for the newest.
        with contextlib.suppress(OSError):
            pointer.unlink()
        raise


def _check_save_args(state: Any, step: Any, keep: Any) -> None:
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint state must be a dict, got {type(state).__name__}; "
                          "pass e.g. {'model': model.state_dict(), 'step': step}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"checkpoint step must be an integer >= 0, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep must be an integer >= 1 (checkpoints to keep), got {keep!r}")


def _newest(directory: Path) -> Optional[Path]:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _prune(directory: Path, final: Path, keep: int) -> None:
    step = _step_of(final)
    # Only older checkpoints count: a higher step (from an abandoned run) is never deleted.
    older = [p for p in list_checkpoints(directory) if _step_of(p) <= step and p != final]
    doomed = older[:max(0, len(older) - (keep - 1))]
    doomed += [p for p in directory.iterdir()            # torn writes left by a crash
               if (m := _TMP.fullmatch(p.name)) and int(m.group(1)) < step]
    for path in doomed:
        remove_shards(path)  # an FSDP checkpoint's shard directory goes with it
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            _warn(f"could not delete old checkpoint {path} ({exc.strerror or exc}); delete it "
                  "by hand")


# --------------------------------------------------------------------------- loading

def load_checkpoint(path: PathLike, map_location: Any = None, *, verify: bool = True) -> dict:
    """Load a checkpoint safely: ``weights_only`` (never runs code), on CPU unless told otherwise.

    Raises :class:`ConfigError` if the file is missing, truncated or corrupted (each record's
    CRC32 is checked first unless ``verify=False``), or holds objects the safe loader refuses.

    Example::

        state = load_checkpoint("ckpt/ckpt-000001000.pt")
        model.load_state_dict(state["model"])
    """
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"checkpoint {path} {what}; check the path")
    verified = verify and _verify_records(path)
    try:
        with warnings.catch_warnings():  # a pickle of protocol 4/5 draws torch's own warning
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location=map_location or "cpu", weights_only=True)
    except PermissionError as exc:
        raise ConfigError(f"checkpoint {path} cannot be read ({exc.strerror}); "
                          "fix its permissions") from None
    except Exception as exc:
        code = code_named(path)  # a pickle that asks for code: refused, whatever torch said
        if code is not None:
            raise ConfigError(refused_line(path, code)) from None
        if isinstance(exc, pickle.UnpicklingError):  # random bytes, a text file
            raise ConfigError(_not_a_checkpoint(path, exc)) from None
        if verified:  # the bytes are intact, so this is not corruption (e.g. a bad map_location)
            raise
        raise ConfigError(_unreadable(path, exc)) from None
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint {path} holds a {type(state).__name__}, not a dict; "
                          "it was not written by save_checkpoint")
    return state


def _verify_records(path: Path) -> bool:
    """Check every zip record's CRC32 (torch.load does not); False for non-zip (legacy) files."""
    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:  # written with torch's crc32 turned off: nothing to compare
                    continue
                with archive.open(info) as f:
                    while f.read(_CHUNK):  # zipfile raises BadZipFile on a CRC mismatch at EOF
                        pass
    except PermissionError:
        return False  # let torch.load report it
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError,
            NotImplementedError) as exc:
        raise ConfigError(_unreadable(path, exc)) from None
    return True


def _short(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0].split(". ")[0] if lines else ""
    text = text if len(text) <= 120 else text[:117] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _unreadable(path: Path, exc: BaseException) -> str:
    return f"checkpoint {path} is unreadable (truncated or corrupted): {_short(exc)}"


def _not_a_checkpoint(path: Path, exc: BaseException) -> str:
    detail = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(exc))
    why = detail.group(1).strip()[:120] if detail else _short(exc)
    return (f"{path} is not a checkpoint (unreadable: neither a torch.save archive nor a pickle "
            f"of tensors; {why}); pass a file written by save_checkpoint")


def find_latest(directory: PathLike, map_location: Any = None, *, quiet: bool = False,
                fits: Optional[Fits] = None) -> Optional[Tuple[Path, dict]]:
    """The newest loadable checkpoint in ``directory`` and its state, or ``None`` if there is none.

    Tries them in :func:`resume_order` (a checkpoint written after the ``latest`` pointer last
    moved, the pointer's, then the rest newest first). Skipped, each with a ``warning:`` line from
    rank 0 (none when ``quiet``: a launcher's look ahead of the ranks that will say it): the
    unreadable (torn, corrupted, refused), and another model's (``fits(state)`` says why, or
    None), unless none is this run's (the newest: the caller refuses it). Raises ConfigError
    when checkpoints exist but none of them loads (rather than silently starting over).

    Example::

        found = find_latest("ckpt")
        if found:
            path, state = found
    """
    directory = Path(directory).expanduser()
    order = resume_order(directory, quiet=quiet)
    said: List[str] = []
    foreign: List[Tuple[Path, dict, str]] = []  # another model's: kept to be said or refused
    for path in order:
        try:
            state = _with_shards(path, load_checkpoint(path, map_location))
        except ConfigError as exc:
            said.append(str(exc))
            _warn(f"{exc}; skipping it", quiet)
            continue
        why = fits(state) if fits is not None else None
        if why is None:
            for other, _, reason in foreign:  # said once the one resumed instead is known
                _warn(f"{other} does not belong to this run ({reason}): skipped; resuming "
                      f"from {path}", quiet)
            return path, state
        foreign.append((path, {} if foreign else state, why))
    if foreign:  # none is this run's: the run asks for another model, as its caller says
        return foreign[0][0], foreign[0][1]
    if order:  # quiet: no warning above to point at, so the newest one's reason
        why = f"the newest: {said[0]}" if quiet else "see the warnings above"
        raise ConfigError(f"none of the {len(order)} checkpoints in {directory} could be loaded "
                          f"({why}); move them away to start fresh")
    return None


def resume_order(directory: PathLike, *, quiet: bool = False) -> List[Path]:
    """The checkpoints of ``directory`` in the order a resume tries them: the first is the one
    it takes when it loads (what a stop line should name).

    The ``latest`` pointer names the newest checkpoint of the run's own timeline (a run resumed
    from an older checkpoint writes below a newer one of an abandoned timeline), but it moves
    only after its checkpoint is written: a checkpoint written after the pointer last moved
    (its save stopped between the rename and the pointer: a slow fsync, a SIGKILL) is complete
    and newer, so it comes first. Then the pointer's, then the rest, newest first.

    Example::

        resume_order("runs/demo/checkpoints")[0]   # .../ckpt-000000120.pt
    """
    directory = Path(directory).expanduser()
    files = list_checkpoints(directory)
    pointed = _pointer_target(directory, quiet) if files else None
    if pointed is None or pointed not in files:
        return list(reversed(files))
    moved = (directory / LATEST).stat().st_mtime_ns
    after = [p for p in reversed(files) if p.stat().st_mtime_ns > moved and
             _step_of(p) > _step_of(pointed)]
    return after + [pointed] + [p for p in reversed(files) if p != pointed and p not in after]


def _warn(text: str, quiet: bool = False) -> None:
    """A checkpoint problem worked around: one ``warning:`` line from rank 0, as ddpkit says its
    other warnings (not a Python warning, which shows ddpkit's file and source line)."""
    if not quiet and comm.is_main():
        print(f"warning: {text}", file=sys.stderr, flush=True)


def _with_shards(path: Path, state: dict) -> dict:
    """``state``, after checking that the shard directory it names (FSDP) is complete."""
    shards = state.get("sharded") if isinstance(state, dict) else None
    if shards and not (path.parent / shards / ".metadata").is_file():
        raise ConfigError(f"checkpoint {path} names shards {shards}/ that are missing or "
                          "incomplete")
    return state


def _pointer_target(directory: Path, quiet: bool = False) -> Optional[Path]:
    pointer = directory / LATEST
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        _warn(f"ignoring unreadable {pointer} ({exc}); scanning for checkpoints", quiet)
        return None
    if not _NAME.fullmatch(name):  # also refuses paths that would leave the directory
        _warn(f"ignoring {pointer}: {name[:60]!r} is not a checkpoint name; scanning for "
              "checkpoints", quiet)
        return None
    return directory / name


def resolve_resume(resume: Optional[PathLike], directory: PathLike,
                   map_location: Any = None, *, quiet: bool = False,
                   fits: Optional[Fits] = None) -> Optional[Tuple[Path, dict]]:
    """Turn a ``--resume`` value into ``(path, state)``, or ``None`` to start fresh.

    ``None``/``""``: no resume. ``"auto"``: the newest checkpoint in ``directory`` that ``fits``,
    if any. A file path loads that file; a directory path loads its newest checkpoint. An explicit
    path that does not exist or holds nothing raises :class:`ConfigError`. ``quiet`` and
    ``fits``: see :func:`find_latest` (a path given is taken as it is).

    Example::

        found = resolve_resume(args.resume, args.checkpoint_dir)
        if found is None:
            print0("starting fresh")
    """
    if resume is None or str(resume) == "":
        return None
    if str(resume) == "auto":
        return find_latest(directory, map_location, quiet=quiet, fits=fits)
    path = Path(resume).expanduser()
    if not path.is_dir():
        return path, _with_shards(path, load_checkpoint(path, map_location))
    found = find_latest(path, map_location, quiet=quiet)
    if found is None:
        raise ConfigError(f"resume directory {path} holds no checkpoint (ckpt-*.pt); pass a "
                          "checkpoint file, or 'auto' to start fresh when there is none")
    return found


def checkpoint_metadata() -> Dict[str, Any]:
    """Versions to store in a checkpoint so a later run can tell what wrote it.

    Example::

        state["meta"] = checkpoint_metadata()   # {'ddpkit': '0.1.0', 'torch': ..., 'format': 1}
    """
    from ..version import __version__

    # str(): torch.__version__ is a TorchVersion, which the weights_only loader refuses.
    return {"ddpkit": __version__, "torch": str(torch.__version__), "format": FORMAT_VERSION}


# What a whole checkpoint holds beside its weights (a user's {"model": ..., "epoch": 3} is not one).
_RUN_PARTS = ("progress", "config", "meta")


def holds_run(state: object) -> bool:
    """Whether a loaded ``state`` is a whole checkpoint of a run (ddpkit's own): its weights, held
    (``"model"``) or written beside it as shards (``"sharded"``, FSDP), and what the run recorded
    with them. Every engine's checkpoint answers True; a plain ``state_dict`` or a user's own dict
    answers False.

    Example::

        holds_run(load_checkpoint("runs/demo/checkpoints/ckpt-000000046.pt"))   # True
        holds_run(nn.Linear(2, 2).state_dict())                                  # False
    """
    return (isinstance(state, dict) and ("model" in state or bool(state.get("sharded")))
            and any(k in state for k in _RUN_PARTS))
