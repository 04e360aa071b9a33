"""The main job on every rank: build data, model, optimizer and schedule from a ``TrainConfig``,
then :func:`ddpkit.fit`. ``python -m ddpkit.job.train CONFIG.json`` is the worker entry that
``ddpkit train`` launches; :mod:`.start` decides how.
"""
from __future__ import annotations

import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..engines import comm
from ..cost.auto import choice_of
from ..checkpoint.names import checkpoint_name, list_checkpoints
from ..checkpoint.write import SaveError, atomic_write
from ..training.log import banner
from ..training.tracking import with_tensorboard
from ..training.loop import CheckpointPolicy, FitConfig, TrainState, fit
from ..training.precision import Precision, gpu_math
from ..data.resident import describe
from ..training.runtime import setup
from ..base.seed import seed_everything
from .build import build_datasets, build_optimizer, build_scheduler, build_wrapped_model
from .check import check_batch_fits, check_config
from .config import RECORDED, TrainConfig, config_from_dict
from .datasets import dataset_key
from .evaluate_only import evaluate_checkpoint

__all__ = ["train", "main"]


def fit_config(cfg: TrainConfig, rt: Any, test_set: Any, scheduler: Any,
               interval: str) -> FitConfig:
    """The :class:`~ddpkit.training.loop.FitConfig` that ``cfg`` asks for (the job's objects included).

    Example::

        fit(rt, model, optimizer, loader, fit_config(cfg, rt, test_set, None, "epoch"))
    """
    policy = CheckpointPolicy(os.path.join(cfg.output, "checkpoints"), cfg.ckpt_every_steps,
                              cfg.ckpt_every_minutes, cfg.ckpt_every_epoch, cfg.ckpt_keep,
                              cfg.resume, cfg.ckpt_async, cfg.ckpt_mtbf_hours)
    return FitConfig(
        epochs=cfg.epochs, precision=Precision(cfg.precision, rt.device),
        accum_steps=cfg.accum_steps, clip_norm=cfg.clip_grad, scheduler=scheduler,
        scheduler_interval=interval, eval_data=test_set, eval_every=cfg.eval_every,
        eval_batch_size=cfg.eval_batch_size, logger=rt.tracking, checkpoint=policy,
        max_steps=cfg.max_steps, skip_nonfinite=cfg.skip_nonfinite,
        channels_last=cfg.channels_last, log_every=cfg.log_every, progress=cfg.progress,
        perplexity=dataset_key(cfg.data) == "text", config=cfg.to_dict())


def train(cfg: TrainConfig) -> TrainState:
    """Run one training job on this process (call it on every rank).

    Example::

        state = train(TrainConfig(epochs=2, nproc=1))
        print(state.best)
    """
    rt = setup(backend=cfg.backend, accelerator=cfg.accelerator, seed=cfg.seed,
               timeout=timedelta(seconds=cfg.timeout_s), deterministic=cfg.deterministic,
               engine=cfg.engine, log_to=with_tensorboard(cfg.log_to), log_dir=cfg.output)
    check_config(cfg, rt.world_size, rt.device.type == "cuda")
    gpu_math(rt.device, tf32=cfg.tf32, deterministic=cfg.deterministic)
    banner(rt.env, rt.device, rt.backend)
    train_set, test_set = build_datasets(cfg)
    if cfg.eval_only:  # no training loader: any number of processes evaluates exactly
        metrics = evaluate_checkpoint(cfg, rt, build_wrapped_model(cfg, rt, train_set), test_set)
        rt.shutdown()
        return TrainState(step=metrics["step"], history=[metrics])
    check_batch_fits(cfg, len(train_set), rt.world_size)
    model = build_wrapped_model(cfg, rt, train_set)
    # Weights were initialised identically; from here on each rank gets its own random stream,
    # so augmentation done in the main process (workers=0) differs between ranks.
    seed_everything(cfg.seed, rank_offset=1 + rt.rank)
    loader = rt.loader(train_set, batch_size=cfg.batch_size, accum_steps=cfg.accum_steps,
                       seed=cfg.seed, num_workers=cfg.workers, resident=cfg.device_data)
    again = rt.env.restart_count > 0  # a restart: the launcher said why; the set-up is the same
    if loader.resident is not None and not again:
        comm.print0(describe(loader.resident))
    # The engine's optimizer: Horovod's DistributedOptimizer (--comm-hook fp16 compresses there).
    optimizer = rt.optimizer(build_optimizer(cfg, model), model, cfg.accum_steps,
                             compression=cfg.comm_hook)
    scheduler, interval = build_scheduler(cfg, optimizer,
                                          math.ceil(len(loader) / cfg.accum_steps))
    if not again and getattr(loader, "live", None) is not None:
        comm.print0(f"train: {len(train_set)} samples, test: {len(test_set)} samples, "
                    f"{len(loader)} steps of {loader.batch.global_batch} samples per epoch, "
                    "each split over the replicas alive at that step")
    elif not again:
        comm.print0(f"train: {len(train_set)} samples, test: {len(test_set)} samples, "
                    f"{len(loader)} micro-batches of {loader.batch_size} per process per epoch")
    state = fit(rt, model, optimizer, loader, fit_config(cfg, rt, test_set, scheduler, interval))
    _report(cfg, state, choice_of(model))
    rt.shutdown()
    return state


def _report(cfg: TrainConfig, state: TrainState, chosen: Any = None) -> None:
    if not comm.is_main() or not state.history:
        return
    last = state.history[-1]
    summary = {"final": last, "best_top1": state.best, "best_epoch": state.best_epoch,
               "steps": state.step, "epochs": state.epoch}
    if cfg.skip_nonfinite:  # every epoch of the run, resumed ones included (kept in history)
        summary["skipped_steps"] = sum(int(h.get("train/skipped_steps", 0))
                                       for h in state.history)
    if chosen is not None:  # --comm-hook auto: what it chose, kept with the run
        summary["comm_hook"] = chosen.to_dict()
    path = os.path.join(cfg.output, "results.json")
    try:
        _write_json(path, summary)  # whole or not at all: never an empty results.json
        if chosen is not None:
            _record_choice(os.path.join(cfg.output, "config.json"), chosen.to_dict())
    except OSError as exc:  # a full disk at the very end: the training itself is done
        raise SaveError(_not_written(cfg, path, exc, summary, state.step)) from None
    if "eval/perplexity" in last:
        print(f"final: validation loss {last['eval/loss']:.4f}, perplexity "
              f"{last['eval/perplexity']:.2f}, next-byte top-1 {last['eval/top1']:.2f}% over "
              f"{last['eval/count']} tokens; run dir {cfg.output}", flush=True)
    elif "eval/top1" in last:
        print(f"final: top-1 {last['eval/top1']:.2f}% on {last['eval/count']} test samples "
              f"(best {state.best:.2f}% at epoch {state.best_epoch}); run dir {cfg.output}",
              flush=True)


def _write_json(path: str, values: Any) -> None:
    # through checkpoint.write's atomic write (temp file, fsync, rename): whole or not at all
    atomic_write(Path(path), lambda f: f.write(json.dumps(values, indent=2).encode()))


def _not_written(cfg: TrainConfig, path: str, exc: OSError, summary: dict, step: int) -> str:
    """The line for a results.json the disk refused: resumable from the checkpoint of the run's
    last step when there is one; otherwise the summary is printed (not lost) and no command that
    would train again from the start is suggested."""
    why = f"cannot write {path} ({exc.strerror or exc})"
    if checkpoint_name(step) in {p.name for p in
                                 list_checkpoints(os.path.join(cfg.output, "checkpoints"))}:
        return (f"{why}; the run finished and its last checkpoint (step {step}) is intact: free "
                f"space, then `ddpkit train --config {os.path.join(cfg.output, 'config.json')} "
                "--resume auto` writes it again")
    print("results: " + json.dumps(summary), flush=True)
    return (f"{why}; the run finished but kept no checkpoint of its last step (step {step}), so "
            "nothing can write it later: its results are the `results:` line above (a rerun "
            "would train again from the start)")


def _record_choice(path: str, chosen: dict) -> None:
    """Add what ``--comm-hook auto`` chose to the run's config.json (``comm_hook_chosen``: a
    record, not an option: a resumed run measures and chooses again)."""
    with open(path) as f:
        values = json.load(f)
    values[RECORDED[0]] = chosen
    _write_json(path, values)


USAGE = ("usage: python -m ddpkit.job.train CONFIG.json\n\nThe worker of `ddpkit train`: runs "
         "the job in CONFIG.json (the resolved config `ddpkit train` writes into its run "
         "directory) on this rank. Start jobs with `ddpkit train`; see `ddpkit train --help`.")


def main(argv: Any = None) -> int:
    """Worker entry: ``python -m ddpkit.job.train RESOLVED_CONFIG.json``.

    Example::

        main(["runs/demo/config.json"])
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(args) != 1:
        print(USAGE.splitlines()[0] + " (normally started by `ddpkit train`)", file=sys.stderr)
        return 2
    try:
        with open(args[0]) as f:
            values = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read the job config {args[0]!r} ({exc}); pass the config.json "
              "that `ddpkit train` wrote", file=sys.stderr)
        return 2
    train(config_from_dict(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
