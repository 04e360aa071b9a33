"""Environment detection for every launcher, from plain dicts (no processes)."""
import pytest

from ddpkit.env import detect, spawn_env, to_environ
from ddpkit.errors import ConfigError

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job7"}

SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train"}


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
