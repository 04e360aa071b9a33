"""Exact resume for any training loop: :class:`Checkpointer` saves the whole run (weights,
optimizer, schedule, scaler, the loader's place mid-epoch, every rank's RNG, the user's extras)
and restores it; one call per optimizer step also turns SIGTERM / SIGUSR1 into "save, then stop".

:func:`ddpkit.fit` runs on it too, so a user's loop and ``fit`` share one checkpoint path.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence, Set, Union

from torch import nn

from ..engines import comm
from .arguments import (check_extra_names, check_options, check_parts,
                        check_same_on_every_rank)
from .background import BackgroundSaver, gathered_rng
from .files import (_save_on_main, checkpoint_metadata, checkpoint_name, load_checkpoint,
                    resolve_resume, save_checkpoint)
from ..base.observe import own_directory
from .advice import world_change_line
from ..base.seed import rng_state, set_rng_state
from .cadence import Cadence
from .names import list_checkpoints
from .position import where
from .shared_dir import check_shared
from .per_rank import gather_extras
from .registry import check_register, restore_value, stateful
from .restore import load_parts, load_weights, next_position, not_this_run
from . import live as live_steps
from . import ray_train
from .sharded import (async_group, async_writer, is_sharded, remove_shards, save_shards,
                      start_shards)
from .stopping import StopQuestions, last_save_ends_stop, stop_line
from ..faults import stall
from ..faults.stops import StopRequested
from ..base.wrap import unwrap
from ..data.batch import Batch

if TYPE_CHECKING:  # PyTorch's protocol (torch >= 2.4); importing it loads all of DCP (~2 s)
    from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["Checkpointer"]


class Checkpointer:
    """Save and resume a training run exactly, from any loop; create it with
    :meth:`ddpkit.Runtime.checkpointer` on EVERY rank, after the model, optimizer and loader.

    When restoring happens, exactly: in the constructor, when ``resume`` finds a checkpoint
    (``"auto"``: the newest in ``directory``, if any; a path: that file or directory;
    ``None``: never); it prints ``resumed from ... at step N``, and :attr:`resumed` names the
    file. An object given to :meth:`register` later is loaded at once from that checkpoint
    when it holds the name. :meth:`restore` does it again, by hand. Nothing restores later.

    Then call :meth:`step` once after each optimizer step, on every rank: it counts steps,
    saves when due (``every_steps``, ``every_minutes``, each epoch's last batch when
    ``every_epoch``); asked to stop (SIGTERM, SIGUSR1) every rank finishes the same step,
    saves, and exits 128 + signal.

    A checkpoint holds the unwrapped model, the optimizer, ``scheduler``, ``scaler`` (a
    ``GradScaler``) or ``precision``, the loader's position (mid-epoch included, on any number
    of ranks), every rank's RNG and your own state, by name: ``extra`` and :meth:`register`
    (one registry, kept in :attr:`extra`) take PyTorch ``Stateful`` objects (``state_dict`` /
    ``load_state_dict``, as :class:`torch.distributed.checkpoint.stateful.Stateful`: restored
    in place) or plain values (tensors, numbers, strings, lists, dicts: restored into
    :attr:`extra`, the script's own lists and dicts in place). Stored once:
    the weights (under DDP), optimizer, scheduler, scaler, loader position and each extra
    equal on every rank; per rank (each rank restores its own): the RNG streams and each extra
    that differs between ranks (an LSTM's hidden state, say; on another number of ranks it
    starts from its value in ``extra``, said in one line). Writes are
    atomic; the newest ``keep`` are kept. FSDP models save shards that any world size can read.
    ``async_save=True``: a save blocks the step only for a copy of the state into host memory
    (reused); rank 0 writes it in the background, one save in flight at a time, and a
    checkpoint is named newest only once complete on disk. ``every_steps="auto"``: the save
    at step 20 measures the cost, and the interval is Young/Daly's for ``mtbf_hours``.

    Call :meth:`step` last in each optimizer step (after ``scheduler.step()`` and whatever else
    the step changes), and leave the ``with`` block or call :meth:`close` when the loop ends.
    The pieces: :mod:`.cadence` (when a save is due), :mod:`.stopping` (stops),
    :mod:`.registry` (your state), :mod:`.restore` (putting a checkpoint back).

    Example::

        with rt.checkpointer("runs/x/ckpt", model=model, optimizer=opt, loader=loader,
                             scheduler=sched, every_steps=200, extra={"best": 0.0}) as ckpt:
            ckpt.register("ema", ema)                    # resumed: ema is loaded here
            for epoch in range(ckpt.epoch, epochs):     # resumed: continues where it stopped
                for x, y in loader:                      # ... mid-epoch too
                    ...
                    opt.step(); sched.step()
                    ckpt.step()                          # saves when due; stops on SIGTERM
    """

    def __init__(self, rt: Any, directory: Optional[Union[str, Path]], *, model: nn.Module,
                 optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                 precision: Any = None, loader: Any = None,
                 extra: Optional[Mapping[str, Any]] = None, every_steps: int = 0,
                 every_minutes: float = 0.0, every_epoch: bool = True, keep: int = 3,
                 resume: Optional[Union[str, Path]] = "auto",
                 config: Optional[Mapping[str, Any]] = None, async_save: bool = False,
                 mtbf_hours: float = 24.0) -> None:
        check_options(every_steps, every_minutes, keep, extra, mtbf_hours)
        #: when a save is due (every_steps, every_minutes, every_epoch, "auto"), and its advice
        self.cadence = Cadence(every_steps, every_minutes, every_epoch, mtbf_hours)
        check_parts(model, loader)
        check_same_on_every_rank(directory)
        directory = own_directory(directory)  # under ddpkit verify: this run's own
        self.rt, self.model, self.optimizer, self.loader = rt, model, optimizer, loader
        self.parts = {"scheduler": scheduler, "scaler": scaler, "precision": precision}
        self.directory = None if directory is None else Path(directory).expanduser()
        self.keep, self.config = keep, dict(config or {})
        #: Your own state by name (``extra=`` and :meth:`register`): Stateful objects, and
        #: plain values read and updated here; restored on resume.
        self.extra: Dict[str, Any] = dict(extra or {})
        # names the resumed checkpoint put in extra that nobody registered (yet): register()
        # loads their values into the object it is given
        self._unclaimed: Set[str] = set()
        self.global_step = 0          #: optimizer steps done (restored on resume)
        self.resumed: Optional[str] = None   #: the checkpoint this run resumed from, if any
        self.last_saved: Optional[Path] = None   #: the newest checkpoint written (rank 0)
        self.saved_step: Optional[int] = None    #: the step it holds, on every rank
        self._epoch = 0               # without a loader: the epoch a resumed checkpoint names
        self._first_step = 0          # the step this process began counting from
        self._stop_questions = StopQuestions()
        self._resumed_at_end = False  # the checkpoint resumed from was after its epoch's last batch
        self._graceful = contextlib.ExitStack()
        #: asynchronous saves (None: each save writes before the step goes on)
        self.background = BackgroundSaver(_save_on_main) if async_save else None
        sharded = async_save and is_sharded(unwrap(model))  # DCP writes the shards: its own group
        # (DCP's group, its writer, a group to gather the RNG on): all used in the background
        self._shard_writer = (async_group(), async_writer(), async_group()) if sharded else None
        self._waits = 0  # saves in a row that waited for the write before them
        if self.directory is not None:  # several nodes: every one must see the checkpoints
            check_shared(self.directory, rt.env.num_nodes)
        # rt.log's state (the tracker run, the records logged) rides in each checkpoint
        self._tracking = getattr(rt, "tracking", None)
        if self._tracking is not None:
            self._tracking.attach()
        # a Ray Train worker: each checkpoint on disk goes to ray.train.report as well
        self._ray = (ray_train.RayReport(self.directory, rt.is_main)
                     if self.directory is not None and ray_train.running(rt.env) else None)
        if resume:
            self.restore(resume)
        # a fault-tolerant run: heal from a live peer here, step only on committed steps
        self._live = live_steps.attach(self)
        self._started = time.monotonic()  # step time (how often to ask about stops) from here
        # SIGTERM / SIGUSR1 now mark a stop that step() acts on (under a launcher)
        self._graceful.enter_context(rt.stops.graceful())

    # ------------------------------------------------------------------ where the run is
    @property
    def epoch(self) -> int:
        """The epoch to run next: 0 in a fresh run; after a resume the interrupted epoch (its
        remaining batches) or the one after the last finished epoch."""
        if self.loader is None:
            return self._epoch
        return int(self.loader.state_dict()["epoch"])

    @property
    def mid_epoch(self) -> bool:
        """True when the loader stands inside an epoch (some of its batches handed out)."""
        return self.loader is not None and self.loader.state_dict()["samples_done"] > 0

    def _last_batch_out(self) -> bool:
        """Every batch of the epoch handed out (its end, evaluation say, may be to come)."""
        if self.resumed and self.global_step == self._first_step:  # not moved since the resume
            return self._resumed_at_end
        return self.loader is not None and self.loader.at_last_batch

    @property
    def every_steps(self) -> int:
        """Optimizer steps between saves (0: off); with ``"auto"``, 0 until the measuring save
        chooses it."""
        return self.cadence.every_steps

    @property
    def every_minutes(self) -> float:
        """Minutes between saves (0: off), by rank 0's clock."""
        return self.cadence.every_minutes

    @property
    def every_epoch(self) -> bool:
        """Whether each epoch's last batch saves."""
        return self.cadence.every_epoch

    def _where(self, mid: str = "") -> str:
        """' (epoch 2)', ' (end of epoch 3)': the position for the stop and resume lines."""
        state = self.loader.state_dict() if self.loader is not None else None
        return where(state, self._last_batch_out(), mid)

    # ------------------------------------------------------------------ the step
    def step(self, global_step: Optional[int] = None) -> Optional[Path]:
        """After an optimizer step, on every rank: count it, save when due, stop on a signal.

        Returns the checkpoint written (rank 0) or None. ``global_step`` sets the count instead
        of adding one (a loop that keeps its own). On SIGTERM / SIGUSR1 every rank saves after
        the same step and raises :class:`~ddpkit.faults.stops.StopRequested` (exit 128 + signal).

        Example::

            optimizer.step(); ckpt.step()
        """
        if self._live is not None:  # a step that did not commit is given again: not counted
            if not self._live.settle():
                return None
            global_step = self._live.live.step
        self.global_step = self.global_step + 1 if global_step is None else int(global_step)
        self.rt.heartbeat.step(self.global_step)  # read by the other ranks if a collective hangs
        due = self.directory is not None and self.cadence.due(  # the same on every rank
            self.global_step, self._first_step,
            self.loader is not None and self.loader.at_last_batch)
        saved = self.save() if due else None
        # every rank asks about a stop at the same steps, so all stop after the same one
        asking = self._stop_questions.due(self.global_step, self._first_step, self._started,
                                          self.rt.stops.installed)
        if asking and self.background is not None and not due:
            self.background.poll()  # a failed write stops every rank here, one line
        signum = self.rt.stops.poll(self.rt.engine) if asking else None
        if signum is not None:
            self.stop(signum, saved, saved_now=due)
        return saved

    def stop(self, signum: int, saved: Optional[Path] = None, saved_now: bool = False) -> None:
        """Save (unless ``saved_now``, or a save ended after the signal came: that one is the
        stop's) and leave with 128 + ``signum``: every rank calls it (:meth:`step` does on
        SIGTERM / SIGUSR1).

        Example::

            ckpt.stop(signal.SIGTERM)   # saves, says so, raises StopRequested (exit 143)
        """
        self.rt.stops.settle()
        if not saved_now:
            saved = self._save_for_stop()
        self.wait()  # the stop's checkpoint is on disk before the exit
        comm.print0(stop_line(signum, self.global_step, self._where(), saved, self.saved_step,
                              self.directory, self.rt.stops.received_at))
        raise StopRequested(signum)

    def _save_for_stop(self) -> Optional[Path]:
        # A save complete after the signal (under way when it came, say) ends the stop: a
        # second one, on a slow disk, could outlast the launcher's grace period. Every rank votes.
        saved_at = self.cadence.last_save_time if self.saved_step is not None else None
        if last_save_ends_stop(self.rt.stops.received_at, saved_at):
            return self.last_saved
        return self.save()

    def close(self) -> None:
        """The loop is over (every rank): a stop signal that came during the last steps still
        saves and exits with its status; SIGTERM / SIGUSR1 get their default meaning back.

        Example::

            ckpt.close()   # or: with rt.checkpointer(...) as ckpt: ...
        """
        self.wait()  # the last save is on disk when the loop is over
        signum = self.rt.stops.ask_now(self.rt.engine)
        self._graceful.close()
        if self._tracking is not None:  # what was logged is final: append-only trackers get it
            self._tracking.loop_ended()
        if signum is not None:
            self.stop(signum)

    def wait(self) -> None:
        """With ``async_save``: wait until the save in flight is on disk (every rank; raises
        its failure). Saves, stops and :meth:`close` do it themselves.

        Example::

            ckpt.save(); ckpt.wait()   # e.g. before copying the checkpoint elsewhere
        """
        if self.background is not None:
            self.background.finish()
            self._saved()

    def _saved(self) -> None:
        """The newest checkpoint is on disk (every rank): the records it counts go to
        append-only trackers; under Ray Train, Ray gets the checkpoint."""
        if self._tracking is not None and self.rt.is_main:
            self._tracking.saved()
        if self._ray is not None and self.saved_step is not None:
            self._ray.saved(self.saved_step, self.epoch)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is None:
            self.close()
        else:  # an error: no collective (the answer may never come)
            if self.background is not None:
                self.background.join()  # a started write is a whole checkpoint: finish it
            self._graceful.close()

    # ------------------------------------------------------------------ saving
    def save(self) -> Optional[Path]:
        """Save the run now, on every rank (a collective); returns the path on rank 0.

        Example::

            ckpt.save()   # e.g. after the epoch's evaluation
        """
        if self.directory is None or (self._live is not None and not self._live.live.leads()):
            return None  # a fault-tolerant run: the quorum's first replica writes
        began = time.monotonic()
        with stall.phase("checkpoint save"):  # the others may wait a while: not a stall
            if self.background is not None:
                path = self._save_in_background(self.directory)
            else:
                path = self._save_now(self.directory)
        self.last_saved, self.saved_step = path, self.global_step
        if self.background is None:
            self._saved()
        # steps timed since this process began: "auto" chooses, the advice is said once
        self.cadence.saved(began, self.global_step - self._first_step, self._started)
        return path

    def _save_now(self, directory: Path) -> Optional[Path]:
        shards = None
        if is_sharded(unwrap(self.model)):  # every rank writes its shard first
            shards = save_shards(self.model, self.optimizer, directory, self.global_step)
        try:
            return save_checkpoint(self.state_dict(shards), directory, self.global_step,
                                   self.keep)
        except Exception:
            written = directory / checkpoint_name(self.global_step)
            if shards and self.rt.is_main and not written.is_file():  # nothing names them
                remove_shards(written)
            raise

    def _save_in_background(self, directory: Path) -> Optional[Path]:
        waited = self.background.finish()  # one save in flight: wait for the one before
        self._saved()
        self._waits = self._waits + 1 if waited is not None and waited > 0.05 else 0
        if self._waits == 2:  # said once it recurs: the saves come faster than they write
            comm.print0(f"checkpoint: step {self.global_step} waited {waited:.1f} s for the "
                        "previous background write (twice in a row): the writes take longer "
                        "than the time between saves; save less often")
        first = shards = None
        if self._shard_writer is not None:  # every rank copies its shards, DCP writes them
            group, writer, rng_group = self._shard_writer
            shards, written = start_shards(self.model, self.optimizer, directory,
                                           self.global_step, group, writer)
            first = gathered_rng(rng_group, written)
        staged = self._shard_writer[1].host if self._shard_writer else None
        path = self.background.start(self.state_dict(shards, rng=first is None), directory,
                                     self.global_step, self.keep, first, staged)
        return path if self.rt.is_main else None

    def state_dict(self, shards: Optional[str] = None, rng: bool = True) -> Dict[str, Any]:
        """Everything an exact resume needs, gathered on every rank (a collective: the RNG;
        without ``rng`` a background save gathers it). With ``shards`` (FSDP:
        :mod:`ddpkit.checkpoint.sharded` wrote model and optimizer) the checkpoint names that
        directory instead of holding them."""
        weights = {"sharded": shards} if shards else {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}
        loader = self.loader.state_dict() if self.loader is not None else None
        parts = {k: v.state_dict() if v is not None else None for k, v in self.parts.items()}
        check_extra_names(self.extra)  # names may have been added since
        extras = {k: v.state_dict() if stateful(v) else v for k, v in self.extra.items()}
        extras = gather_extras(extras)  # a collective: those that differ are kept per rank
        progress = {"epoch": self.epoch, "step": self.global_step, "mid_epoch": self.mid_epoch,
                    "last_batch_out": self.mid_epoch and self._last_batch_out()}
        batch = getattr(self.loader, "batch", None)
        if isinstance(batch, Batch):  # said on another world size; "global_batch" alone: older
            progress.update(global_batch=batch.global_batch, batch=batch.as_dict())
        return {**weights, **parts, **extras, "loader": loader, "progress": progress,
                "rng": comm.gather_object(rng_state()) if rng else None,
                "world_size": self.rt.world_size, "config": self.config,
                "meta": checkpoint_metadata(),
                **({"log": self._tracking.state_dict()} if self._tracking is not None else {})}

    # ------------------------------------------------------------------ your own state
    def register(self, name: str, obj: Union["Stateful", Any]) -> Any:
        """Save ``obj`` under ``name`` from now on, on every rank: a PyTorch ``Stateful``
        (``state_dict`` / ``load_state_dict``) or a plain value (tensors, numbers, strings,
        lists, dicts), as in ``extra=`` (the same registry, :attr:`extra`). When this run
        resumed from a checkpoint that holds ``name``, it is loaded at once: the object in
        place, a plain value into :attr:`extra` (a list or dict refilled in place). Returns
        what :attr:`extra` holds under ``name`` now. A name the checkpoint uses itself or one
        registered already, or an object neither Stateful nor plain: a one-line
        :class:`~ddpkit.ConfigError`.

        Example::

            ckpt = rt.checkpointer("runs/x/ckpt", model=model, optimizer=opt, loader=loader)
            ckpt.register("ema", ema)                  # resumed: ema holds the saved weights
            best = ckpt.register("best", 0.0)          # resumed: the saved value
        """
        check_register(name, obj, set(self.extra) - self._unclaimed)
        saved = self.extra.get(name)
        self.extra[name] = obj
        if name in self._unclaimed:  # the resumed checkpoint holds it
            self._unclaimed.discard(name)
            restore_value(self.extra, name, saved)
        return self.extra[name]

    # ------------------------------------------------------------------ restoring
    def restore(self, resume: Union[str, Path] = "auto") -> Optional[str]:
        """Continue from ``resume`` (``"auto"`` or a path), if it finds a checkpoint; every
        rank calls it (done by the constructor when ``resume`` is given). Returns the path, or
        None: starting fresh.

        Example::

            ckpt.restore("runs/old/ckpt/ckpt-000000400.pt")
        """
        if str(resume) == "auto" and ray_train.running(self.rt.env):
            with ray_train.newest() as kept:  # a worker group Ray restarted: Ray's newest,
                if kept is not None and not self._newer_here(kept):  # unless ours is newer
                    return self._restore(kept, here=True)
        if self.directory is None and str(resume) == "auto":
            return None
        return self._restore(resume)

    def _newer_here(self, kept: Path) -> bool:
        # Ray registers a report when it next polls the workers: one made just before a
        # failure may be lost, while the file it copied is in this run's own directory.
        newer = None
        if self.rt.env.rank == 0:
            ours = list_checkpoints(self.directory) if self.directory is not None else []
            rays = list_checkpoints(kept)
            newer = bool(ours) and (not rays or ours[-1].name > rays[-1].name)
        return bool(comm.broadcast_object(newer))

    def _restore(self, resume: Union[str, Path], here: bool = False) -> Optional[str]:
        # here: ``resume`` is this rank's own copy (Ray's, downloaded); others load theirs
        # Rank 0 chooses, so every rank resumes from the same file even if one is being damaged.
        # Loaded to the CPU on every device: RNG states must be CPU tensors, and load_state_dict
        # copies weights and optimizer state onto the parameters' device (GPU <-> CPU resumes).
        found = (resolve_resume(resume, self.directory or "", "cpu",  # another model's: skipped
                                fits=lambda s: not_this_run(s, self.model, self.config))
                 if self.rt.env.rank == 0 else None)  # (each fault-tolerant replica: its own)
        chosen = comm.broadcast_object(str(found[0]) if found else None)
        if chosen is None:
            comm.print0(f"no checkpoint in {self.directory}: starting fresh")
            return None
        if here and not found:
            chosen = str(Path(resume) / Path(chosen).name)
        ckpt = found[1] if found else load_checkpoint(chosen, map_location="cpu")
        self.load_state_dict(ckpt, Path(chosen))
        self.resumed = chosen
        # numbered as the stop line numbers it: "at step 9 (epoch 2)", epochs from 1
        comm.print0(f"resumed from {chosen} at step {self.global_step}"
                    f"{self._where(', mid-epoch')}")
        return chosen

    def load_state_dict(self, ckpt: Dict[str, Any], source: Optional[Path] = None) -> None:
        """Put back a whole run's state (what :meth:`state_dict` gave): a checkpoint read by
        :meth:`restore`, or a live peer's state in a fault-tolerant run (a heal).

        Example::

            ckpt.load_state_dict(other.state_dict())
        """
        load_weights(self.model, self.optimizer, ckpt, source or Path("."))
        registered = set(self.extra) - self._unclaimed
        unmapped = load_parts(self.parts, self.extra, ckpt)  # per rank, on another world size
        self._unclaimed = set(self.extra) - registered  # kept (and saved again) for register()
        self._load_position(ckpt, unmapped)
        if self._tracking is not None and ckpt.get("log"):
            self._tracking.load_state_dict(ckpt["log"])

    def _load_position(self, ckpt: Dict[str, Any], unmapped: Sequence[str] = ()) -> None:
        progress = ckpt["progress"]
        self.global_step = self._first_step = int(progress["step"])
        self.rt.heartbeat.step(self.global_step)
        if self.loader is not None and ckpt.get("loader") is not None:
            self.loader.load_state_dict(next_position(ckpt["loader"], progress))
        self._epoch = int(progress["epoch"])
        self._resumed_at_end = bool(progress.get("last_batch_out"))
        if ckpt.get("world_size") == self.rt.world_size:  # per-rank streams: the same ranks only
            set_rng_state(ckpt["rng"][self.rt.rank])
        else:
            comm.print0(world_change_line(ckpt.get("world_size"), self.rt.world_size,
                                          self.global_step, self.loader, self.model,
                                          _saved_batch(ckpt["progress"]), unmapped))


def _saved_batch(progress: Mapping[str, Any]) -> Any:
    """The batch a checkpoint was written with: its :class:`Batch`, or from a checkpoint written
    before one was recorded, the old ``global_batch`` (a micro-batch x the world size) or None."""
    return Batch.recorded(progress) if "batch" in progress else progress.get("global_batch")
