"""Environment detection for every launcher, from plain dicts (no processes)."""
import pytest

from ddpkit.env.detect import detect, spawn_env, to_environ
from ddpkit.base.errors import ConfigError

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job7"}

SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train"}

# What a real Slurm 22.05 gave the tasks of `srun -n 3` in a job of 2 nodes x 2 tasks (the
# private cluster of tests/slurmcluster.py), task 2 (on the second node), abridged: the job's
# --ntasks-per-node says 2, the step's own layout is 2,1.
STEP_OF_3 = {"SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "job.sh", "SLURM_JOB_NODELIST": "node[1-2]",
             "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "3",
             "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
             "SLURM_STEPID": "1", "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "node[1-2]",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "3",
             "SLURM_STEP_TASKS_PER_NODE": "2,1"}
# ... and of `srun -n 2 -N 1 -w node2` in the same job: the step runs on the job's second node.
STEP_ON_NODE2 = dict(STEP_OF_3, SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NTASKS="2",
                     SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEP_ID="0", SLURM_STEPID="0",
                     SLURM_STEP_NODELIST="node2", SLURM_STEP_NUM_NODES="1",
                     SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2")
# ... and of the batch script itself (one process, not a task of a step).
BATCH = {"SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "job.sh", "SLURM_JOB_NODELIST": "node[1-2]",
         "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_NTASKS": "4",
         "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0"}


def test_single_process_default():
    env = detect({})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 1, 0, "single")
    assert not env.is_distributed and env.is_main


def test_torchrun():
    env = detect(TORCHRUN)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.node_rank, env.master_addr, env.master_port) == (1, "10.0.0.1", 29500)
    assert (env.restart_count, env.job_id, env.launcher) == (2, "job7", "torchrun")
    assert env.num_nodes == 2
    assert not env.shared_store


@pytest.mark.parametrize("value, shared", [("True", True), ("False", False), (None, False)])
def test_torchrun_agent_store_sharing(value, shared):
    environ = dict(TORCHRUN) if value is None else dict(TORCHRUN, TORCHELASTIC_USE_AGENT_STORE=value)
    assert detect(environ).shared_store is shared


@pytest.mark.parametrize("argv", [["--local_rank=1"], ["--local-rank", "1"], ["--local_rank", "1"]])
def test_legacy_launch_local_rank_argument(argv):
    environ = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert detect(environ, ["train.py", *argv]).local_rank == 1


def test_slurm():
    env = detect(SLURM)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.node_rank, env.master_addr, env.launcher) == (1, "gpu07", "slurm")
    assert env.master_port == detect(dict(SLURM, SLURM_PROCID="0", SLURM_LOCALID="0",
                                          SLURM_NODEID="0")).master_port
    assert env.master_port == 15000 + 123456 % 20000 and env.job_id == "123456"  # from the job id


def test_slurm_master_addr_override_and_compressed_nodelist():
    env = detect(dict(SLURM, SLURM_JOB_NODELIST="node[01-04,07]"))
    assert env.master_addr == "node01"
    assert detect(dict(SLURM, MASTER_ADDR="head")).master_addr == "head"


def test_slurm_step_layout_comes_from_the_step():
    env = detect(STEP_OF_3)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (2, 3, 0, 1)
    assert (env.node_rank, env.master_addr, env.nodelist) == (1, "node1", "node[1-2]")
    env = detect(STEP_ON_NODE2)
    assert (env.rank, env.world_size, env.local_world_size, env.node_rank) == (1, 2, 2, 0)
    assert env.master_addr == "node2"  # the step's first node, not the job's
    assert env.num_nodes == 1


def test_the_number_of_nodes_is_the_same_on_every_rank_of_an_uneven_step():
    # 2 + 1 tasks: 3 // 2 would say one node on the first node and three on the second.
    first = dict(STEP_OF_3, SLURM_NODEID="0", SLURM_PROCID="0")
    assert detect(first).num_nodes == detect(STEP_OF_3).num_nodes == 2
    assert detect(dict(TORCHRUN, GROUP_WORLD_SIZE="3")).num_nodes == 3


def test_slurm_batch_script_with_several_tasks_is_one_clear_error():
    with pytest.raises(ConfigError, match="batch script of Slurm job 1, one process, but the job "
                                          "has 4 tasks: start the script with srun"):
        detect(BATCH)
    one = {k: v for k, v in BATCH.items() if k != "SLURM_NTASKS_PER_NODE"}
    one.update(SLURM_NTASKS="1", SLURM_NNODES="1", SLURM_TASKS_PER_NODE="1",
               SLURM_JOB_NODELIST="node1")
    assert detect(one).world_size == 1  # one task: one process, as asked


def test_torchrun_wins_inside_srun():
    env = detect({**SLURM, **TORCHRUN})
    assert env.launcher == "torchrun" and env.rank == 3


def test_interactive_salloc_shell_is_single_process():
    assert detect(dict(SLURM, SLURM_JOB_NAME="bash")).launcher == "single"


def test_slurm_world_size_mismatch_is_explained():
    with pytest.raises(ConfigError, match="slurm started 8 process.*world size 16.*ntasks-per-node"):
        detect(SLURM, expected_world_size=16)


@pytest.mark.parametrize("environ,message", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is impossible with world size 2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "local rank 2 is impossible"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000", "MASTER_ADDR": "h"}, "not a TCP port"),
    (dict(SLURM, SLURM_PROCID="8"), "rank 8 is impossible with world size 8"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "cannot find the master"),
])
def test_inconsistent_values_raise_one_clear_error(environ, message):
    with pytest.raises(ConfigError, match=message):
        detect(environ)


def test_spawn_env_round_trips_through_environ():
    env = spawn_env(1, 3, master_port=1234)
    back = detect(to_environ(env))
    assert (back.rank, back.world_size, back.master_port, back.master_addr) == (1, 3, 1234, "127.0.0.1")
