"""The engine objects: chosen once by setup(), asked by wrap, accumulation and the collectives.

Multi-rank behaviour of each engine is in test_multiprocess.py (DDP) and
test_engines_horovod.py (Horovod); here one process, no group.
"""
import contextlib

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import engines
from ddpkit.engines import comm
from ddpkit.engines.base import Engine
from ddpkit.engines.none import NoneEngine
from ddpkit.engines.torchdist import TorchEngine
from ddpkit.engines.ddp import DDPEngine
from ddpkit.engines.dp import DPEngine
from ddpkit.engines.fsdp import FSDPEngine
from ddpkit.engines.horovod import HorovodEngine
from ddpkit.env.detect import ClusterEnv
from ddpkit.cli import build_parser
from ddpkit.cli.train import resolve
from ddpkit.base.errors import ConfigError
from ddpkit.job.config import config_from_dict
from ddpkit.base.wrap import WrapOptions


def test_one_engine_per_name():
    made = {name: engines.create(name) for name in engines.ENGINES}   # every name offered
    assert {name: type(engine) for name, engine in made.items()} == {
        "ddp": DDPEngine, "fsdp": FSDPEngine, "dp": DPEngine, "horovod": HorovodEngine,
        "none": NoneEngine}
    assert all(engine.name == name for name, engine in made.items())


def test_the_interface_the_torch_collectives_and_the_none_engine_are_three_classes():
    # the interface cannot be made without its abstract parts; every torch engine shares one
    # start-up and one set of collectives; Horovod is an engine without torch's collectives
    with pytest.raises(TypeError, match="abstract"):
        Engine()
    for cls in (DDPEngine, FSDPEngine, DPEngine, NoneEngine):
        assert issubclass(cls, TorchEngine) and cls.all_reduce is TorchEngine.all_reduce
    assert not issubclass(HorovodEngine, TorchEngine) and issubclass(HorovodEngine, Engine)
    assert NoneEngine().wrap(nn.Linear(2, 1), None, torch.device("cpu"),
                             WrapOptions()).__class__ is nn.Linear


def test_setup_keeps_the_chosen_engine_on_the_runtime():
    rt = ddpkit.setup(env=ClusterEnv(), engine="none")
    assert rt.engine.name == "none" and "engine=none" in repr(rt)
    assert ddpkit.setup(env=ClusterEnv()).engine.name == "ddp"       # auto, not under horovodrun
    assert ddpkit.setup(env=ClusterEnv(), engine="torch").engine.name == "ddp"  # the old name
    with pytest.raises(ConfigError, match="unknown engine 'deepspeed'; choose one of auto, ddp, "
                                          "fsdp, dp, horovod, none"):
        ddpkit.setup(env=ClusterEnv(), engine="deepspeed")


def test_an_unknown_engine_is_the_same_error_from_every_entry_point(capsys):
    rt = ddpkit.setup(env=ClusterEnv())
    with pytest.raises(ConfigError, match="^unknown engine 'deepspeed'; choose one of ddp, "):
        rt.wrap(nn.Linear(2, 2), engine="deepspeed")
    with pytest.raises(ConfigError, match="^config key 'engine' must be one of ddp, fsdp"):
        config_from_dict({"engine": "deepspeed"})
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'deepspeed'", exit 2
        build_parser().parse_args(["train", "--engine", "deepspeed"])
    assert "invalid choice: 'deepspeed'" in capsys.readouterr().err


def test_the_old_name_strategy_still_works_with_a_note(capsys):
    rt = ddpkit.setup(env=ClusterEnv())
    with pytest.warns(FutureWarning, match=r"rt.wrap\(strategy=...\) is now rt.wrap\(engine=...\)"):
        model = rt.wrap(nn.Linear(2, 2), strategy="none")
    assert isinstance(model, nn.Linear)
    assert config_from_dict({"strategy": "none"}).engine == "none"
    assert "note: 'strategy' is now 'engine'; the old name still works" in capsys.readouterr().err
    cfg = resolve(build_parser().parse_args(["train", "--strategy", "fsdp"]))
    assert cfg.engine == "fsdp"
    assert "note: --strategy is now --engine; the old name still works" in capsys.readouterr().err


def test_an_engine_in_wrap_wraps_that_model_only_and_ddp_under_horovod_stays_horovod():
    rt = ddpkit.setup(env=ClusterEnv())
    with pytest.warns(UserWarning, match="engine 'dp' needs CUDA"):
        rt.wrap(nn.Linear(2, 2), "dp")
    assert rt.engine.name == "ddp"   # setup(engine=...) chooses for the run; wrap for one model
    assert HorovodEngine().serves("ddp") and not DDPEngine().serves("horovod")


def test_without_a_group_the_collectives_answer_for_one_process():
    engine = engines.active()
    assert engine.name == "none" and (engine.rank(), engine.world_size()) == (0, 1)
    t = torch.tensor([1.5, 2.0])
    assert engine.all_reduce(t, "sum") is t
    mean = engine.all_reduce(t, "mean")
    assert mean is not t and torch.equal(mean, t)
    assert engine.all_gather_object({"a": 1}) == [{"a": 1}]
    assert engine.broadcast_object("x") == "x"
    assert comm.reduce(3, "sum") == 3 and comm.gather_object(7) == [7]


class Recording(NoneEngine):
    """An engine that records what accumulation asks of it."""

    def __init__(self):
        self.calls = []

    def no_sync(self, model):
        self.calls.append("no_sync")
        return contextlib.nullcontext()

    def synchronized(self, optimizer):
        self.calls.append("synchronized")
        return contextlib.nullcontext()


def test_accumulation_asks_the_engine_not_the_model_type():
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = Recording()
    acc = ddpkit.Accumulator(net, opt, steps=3, engine=engine)
    for _ in range(3):
        with acc.micro_step():
            acc.backward(net(torch.ones(2, 3)).sum())
    assert engine.calls == ["no_sync", "no_sync", "synchronized"]
    assert acc.optimizer_steps == 1


def test_the_torch_engine_skips_the_all_reduce_of_anything_that_offers_no_sync():
    class Wrapper(nn.Module):
        entered = 0

        @contextlib.contextmanager
        def no_sync(self):
            Wrapper.entered += 1
            yield

    with NoneEngine().no_sync(Wrapper()):
        pass
    with NoneEngine().no_sync(nn.Linear(1, 1)):   # a plain module has nothing to skip
        pass
    assert Wrapper.entered == 1


def test_horovod_outside_horovodrun_refuses_several_processes_and_is_a_no_op_alone():
    engine = HorovodEngine()
    assert not engine.running()
    net = nn.Linear(2, 2)
    assert engine.wrap(net, ClusterEnv(), torch.device("cpu"), WrapOptions()) is net
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert engine.optimizer(opt, net) is opt

