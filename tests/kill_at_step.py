"""Run a script unchanged, killing one rank (kill -9) right after its N-th optimizer step on the
first attempt: a crash test for scripts that have no kill flag of their own (examples/).

    ddpkit run --nproc 2 --max-restarts 1 tests/kill_at_step.py --rank 1 --step 7 -- \\
        examples/lm_bptt.py --out DIR
"""
import argparse
import os
import runpy
import signal
import sys

from torch.optim.optimizer import register_optimizer_step_post_hook


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("script", nargs=argparse.REMAINDER)
    args = p.parse_args()
    script = [a for a in args.script if a != "--"]
    steps = [0]

    def stepped(optimizer, *_):
        steps[0] += 1
        if (steps[0] == args.step and int(os.environ.get("RANK", "0")) == args.rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(stepped)
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


if __name__ == "__main__":
    main()
