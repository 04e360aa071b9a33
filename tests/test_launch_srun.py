"""`ddpkit run` as a task of an srun step: the layout checks, from the variables a real Slurm 22.05
gave (tests/test_slurm.py runs the same on a real cluster)."""
import os
import subprocess
import sys

import pytest

from ddpkit.base.errors import JobSetupError
from ddpkit.launchers.srun import check_layout, is_first_task, step_task

HERE = os.path.dirname(os.path.abspath(__file__))
# Task 1 (on node2) of `srun ddpkit run ...` in a job of 2 nodes x 1 task.
TASK = {"SLURM_JOB_ID": "5", "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURMD_NODENAME": "node2"}


def test_a_task_of_a_step_is_known_and_the_batch_script_is_not():
    assert step_task(TASK) == 1 and not is_first_task(TASK)
    assert step_task({k: v for k, v in TASK.items() if "STEP" not in k}) is None  # batch script
    assert step_task(dict(TASK, RANK="0")) is None  # a torchrun worker inside the step
    assert is_first_task({}) and is_first_task(dict(TASK, SLURM_PROCID="0"))


def test_one_task_per_node_on_the_steps_nodes_passes():
    check_layout(2, 4, TASK)
    check_layout(5, 1, {})  # not under srun: nothing to check


@pytest.mark.parametrize("changes, nnodes, words", [
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4"}, 2,
     "srun started 2 tasks on node1 (tasks per node: 2(x2))"),
    # Every task decides from the whole step: the one alone on node1 stops too.
    ({"SLURM_STEP_TASKS_PER_NODE": "1,2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NODEID": "0",
      "SLURM_PROCID": "0"}, 2, "srun started 2 tasks on node2 (tasks per node: 1,2)"),
    ({}, 3, 'ddpkit run --nnodes 3, but this srun step runs on 2 node(s): pass --nnodes '
            '"$SLURM_NNODES"'),
])
def test_a_wrong_layout_is_one_error(changes, nnodes, words):
    with pytest.raises(JobSetupError) as err:
        check_layout(nnodes, 1, dict(TASK, **changes))
    assert words in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("procid, lines", [("0", 1), ("1", 0)])
def test_the_cli_says_it_from_the_first_task_only(tmp_path, procid, lines):
    script = tmp_path / "t.py"
    script.write_text("print('never runs')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(TASK, SLURM_PROCID=procid, SLURM_STEP_TASKS_PER_NODE="2(x2)")
    res = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "--nproc", "1",
                          "--rdzv-endpoint", "127.0.0.1:29999", str(script)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2
    assert len(res.stderr.splitlines()) == lines, res.stderr
    assert "never runs" not in res.stdout
