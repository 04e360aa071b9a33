"""tests/own_loop_script.py's loop (augmentation from the global RNGs, DataLoader workers,
dropout, evaluation mid-training, uneven shards, ``rt.checkpointer``) as the
``train_loop_per_worker`` of Ray Train's ``TorchTrainer`` on a local Ray cluster (CPU workers).

``ddpkit.setup()`` adopts the group Ray made; each checkpoint goes to ``ray.train.report``; with
``--kill-step`` a worker kills itself (kill -9) on the first attempt and Ray's
``FailureConfig(max_failures=1)`` starts the group again, which resumes from Ray's checkpoint.

    python tests/ray_script.py --out DIR -- --workers 2 --eval-every 4 --kill-rank 1 --kill-step 7
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def train_loop(config):
    """Ray Train's function, on every worker: own_loop_script's main, its --attempt from Ray."""
    sys.path.insert(0, config["here"])
    import torch

    import ddpkit
    import own_loop_script as script

    log_to = script.parser().parse_args(config["argv"]).log_to
    # rt.log's directory left to its default: under Ray, <storage_path>/<run name>/log
    rt = ddpkit.setup(seed=0, deterministic=True, **({} if log_to is None else {"log_to": log_to}))
    out = config["argv"][config["argv"].index("--out") + 1]
    attempt = len([n for n in os.listdir(out) if n.startswith("attempt-")])  # Ray's restarts
    torch.distributed.barrier()  # every rank has counted before rank 0 marks this attempt
    if rt.is_main:
        open(os.path.join(out, f"attempt-{attempt}"), "w").close()
    args = script.parser().parse_args(config["argv"] + ["--attempt", str(attempt)])
    script.maybe_kill = _after_ray_has_the_checkpoint(script.maybe_kill, args)
    model, steps, evals = script.own_loop(rt, args)
    if rt.is_main:
        params = [p.detach().clone() for p in rt.unwrap(model).parameters()]
        torch.save({"params": params, "step": steps, "evals": evals, "launcher": rt.env.launcher},
                   os.path.join(args.out, "final.pt"))
    rt.shutdown()


def _after_ray_has_the_checkpoint(kill, args):
    # Ray registers a report when it next polls the workers (every 2 s): the kill waits until
    # Ray holds the checkpoint before it, so the restart's resume from Ray's copy is certain.
    def waiting(rt, args_, step):
        if args.attempt == 0 and rt.rank == args.kill_rank and step == args.kill_step:
            import ray.train

            ray.train.get_all_reported_checkpoints(
                consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        kill(rt, args_, step)
    return waiting


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers (ranks)")
    p.add_argument("--max-failures", type=int, default=1)
    p.add_argument("--ray-tmp", default=None, help="Ray's session directory (a short path)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="own_loop_script's flags, after --")
    args = p.parse_args()
    argv = [a for a in args.script if a != "--"] + ["--out", args.out]

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network here
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=args.workers, include_dashboard=False, _temp_dir=args.ray_tmp,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    trainer = TorchTrainer(
        train_loop, train_loop_config={"argv": argv, "here": HERE},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(storage_path=os.path.join(os.path.abspath(args.out), "ray"),
                             name="run", failure_config=FailureConfig(args.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    result = trainer.fit()
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump({"error": None if result.error is None else str(result.error),
                   "checkpoint": result.checkpoint.path if result.checkpoint else None,
                   "metrics": result.metrics}, f)
    ray.shutdown()
    sys.exit(0 if result.error is None else 1)


if __name__ == "__main__":
    main()
