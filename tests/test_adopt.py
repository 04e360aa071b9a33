"""A process group that another library made before ``ddpkit.setup()``: a script started by
``accelerate launch`` that creates Accelerate's ``Accelerator`` first, and one that Lightning
Fabric's launcher starts (``Fabric(...).launch()``; it sets no ``RANK``). ddpkit adopts the group
and the run ends bitwise equal to the same script under ``ddpkit run``; a model another library
wrapped already is refused in one line (two wrappers would all-reduce every gradient twice).
"""
import os
import subprocess
import sys

import pytest
from torch import nn
from torch.nn import DataParallel

from ddpkit.base.errors import ConfigError
from ddpkit.base.wrap import check_not_wrapped
from ddpkit.env.detect import adopt, detect
from ddpkit.faults.alike import heard, said_by_rank_0

from test_own_loop import assert_bitwise_equal, assert_every_sample_once, final, run

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "own_loop_script.py")
FLAGS = ["--workers", "2", "--eval-every", "4"]


def test_a_group_made_before_setup_gives_the_rank_and_size_the_variables_do_not():
    # Fabric's launcher: LOCAL_RANK, NODE_RANK, WORLD_SIZE, MASTER_*; no RANK
    environ = {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "51521"}
    env = adopt(detect(environ), rank=1, world_size=2, hosts=["a", "a"], environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)
    assert (env.launcher, env.master_port, env.num_nodes) == ("adopted", 51521, 1)
    # two hosts of two ranks each: the node and the local rank come from the host names
    env = adopt(detect({}), rank=3, world_size=4, hosts=["a", "a", "b", "b"], environ={})
    assert (env.node_rank, env.local_rank, env.local_world_size, env.num_nodes) == (1, 1, 2, 2)


def test_a_model_another_library_wrapped_is_refused_in_one_line():
    class Wrapper(nn.Module):  # as Fabric's _FabricModule holds its DDP
        def __init__(self):
            super().__init__()
            self._forward_module = DataParallel(nn.Linear(2, 2))

    with pytest.raises(ConfigError, match="another library wrapped it already"):
        check_not_wrapped(Wrapper())
    check_not_wrapped(nn.Sequential(nn.Linear(2, 2)))  # a plain model passes


def test_a_line_rank_0_said_is_not_said_again_by_the_others():
    # where no launcher stops the other ranks after rank 0 failed (Fabric's): the store decides
    import torch.distributed as dist
    store = dist.HashStore()
    line = "rt.wrap got a _FabricModule with a DistributedDataParallel inside: ..."
    assert not said_by_rank_0(store, 1, line, wait=0.1)   # rank 0 has not said it: rank 1 does
    assert not said_by_rank_0(store, 0, line)             # rank 0 marks it and prints it
    assert said_by_rank_0(store, 1, line, wait=0.1)       # rank 1 stays quiet, and says so
    heard(store, 2, line, wait=5.0)                       # rank 0 leaves at once: rank 1 saw it
    assert not said_by_rank_0(store, 1, "another error", wait=0.1)  # a different line: printed
    assert not said_by_rank_0(None, 1, line)              # no store: every rank says its own


@pytest.mark.slow
def test_wrapping_what_fabric_wrapped_is_one_line_from_rank_0(tmp_path):
    pytest.importorskip("lightning.fabric", reason="lightning is not installed (dev extra)")
    script = tmp_path / "both.py"
    script.write_text(
        "import ddpkit\nfrom torch import nn\nfrom lightning.fabric import Fabric\n"
        "fabric = Fabric(accelerator='cpu', devices=2, strategy='ddp')\nfabric.launch()\n"
        "rt = ddpkit.setup()\nmodel = rt.wrap(fabric.setup(nn.Linear(4, 2)))\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert res.returncode != 0
    errors = [line for line in (res.stdout + res.stderr).splitlines() if "error:" in line]
    assert errors == ["error: rt.wrap got a _FabricModule with a DistributedDataParallel inside: "
                      "another library wrapped it already (fabric.setup, accelerator.prepare); "
                      "pass rt.wrap the plain module, and train either with ddpkit's wrapper or "
                      "with the other library's, not both"], res.stdout + res.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    run(out, FLAGS)  # own_loop_script under ddpkit run --nproc 2, uninterrupted
    return final(out)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["accelerate", "fabric"])
def test_ddpkit_adopts_the_group_of_accelerate_or_fabric_and_trains_the_same(
        tmp_path, reference, how):
    pytest.importorskip({"accelerate": "accelerate", "fabric": "lightning.fabric"}[how],
                        reason=f"{how} is not installed (the dev extra has it)")
    # Accelerate's launcher is torchrun underneath (--multi_gpu on a CPU machine too: its
    # --cpu flag starts one process whatever --num_processes says); Fabric's launch() starts
    # the script again for the second rank
    launch = ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no"] if how == "accelerate" else [sys.executable])
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    res = subprocess.run([*launch, SCRIPT, "--out", str(tmp_path), *FLAGS, "--adopt", how],
                         capture_output=True, text=True, timeout=240, env=env,
                         cwd=str(tmp_path))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert sorted(p.name for p in tmp_path.glob("ledger-*")) == [
        "ledger-r0-a0-w2.jsonl", "ledger-r1-a0-w2.jsonl"]  # two ranks, each knew it
    assert_bitwise_equal(final(tmp_path), reference)
    assert final(tmp_path)["evals"] == reference["evals"]
    assert_every_sample_once(tmp_path)
