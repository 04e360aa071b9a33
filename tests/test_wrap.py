"""Model wrapping without a process group: unwrap, engine checks, single-process no-ops."""
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ddpkit.env.detect import ClusterEnv
from ddpkit.base.errors import ConfigError
from ddpkit.engines import wrap_model
from ddpkit.engines.ddp import register_comm_hook as _register_comm_hook
from ddpkit.base.wrap import WrapOptions, unwrap

CPU = torch.device("cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(2, 1)


def test_wrap_options_defaults():
    o = WrapOptions()
    assert o.gradient_as_bucket_view is True
    assert o.broadcast_buffers is True
    assert (o.sync_bn, o.find_unused_parameters, o.static_graph) == (False, False, False)
    assert (o.bucket_cap_mb, o.comm_hook) == (25.0, None)


def test_unwrap_plain_module_is_itself():
    m = Net()
    assert unwrap(m) is m


def test_unwrap_nested_data_parallel():
    m = Net()
    wrapped = DataParallel(DataParallel(DataParallel(m)))
    assert unwrap(wrapped) is m
    assert unwrap(wrapped).state_dict().keys() == m.state_dict().keys()


def test_unwrap_does_not_descend_into_other_containers():
    inner = Net()
    seq = nn.Sequential(DataParallel(inner))
    assert unwrap(seq) is seq


def test_dp_on_cpu_warns_and_returns_plain_module():
    m = Net()
    with pytest.warns(UserWarning, match=r"^engine 'dp' needs CUDA devices; on CPU the plain "
                                         r"module is used$"):
        out = wrap_model(m, ClusterEnv(), CPU, "dp")
    assert out is m
    assert not isinstance(out, (DataParallel, DistributedDataParallel))


@pytest.mark.parametrize("engine", ["FSDP2", "DDP", "", "deepspeed"])
def test_unknown_engine_lists_choices(engine):
    with pytest.raises(ConfigError) as exc:
        wrap_model(Net(), ClusterEnv(), CPU, engine)
    assert str(exc.value) == (f"unknown engine {engine!r}; choose one of ddp, fsdp, dp, "
                              "horovod, none")


def test_unknown_engine_checked_before_the_model_is_touched():
    m = Net()
    with pytest.raises(ConfigError):
        wrap_model(m, ClusterEnv(), torch.device("meta"), "bogus")
    assert all(p.device == CPU for p in m.parameters())


@pytest.mark.parametrize("engine", ["ddp", "none"])
def test_single_process_returns_the_module(engine):
    m = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for the normal single-process path
        out = wrap_model(m, ClusterEnv(), CPU, engine)
    assert out is m
    assert not isinstance(out, DistributedDataParallel)


@pytest.mark.parametrize("engine", ["ddp", "none"])
def test_single_process_moves_module_to_device(engine):
    m = Net()
    out = wrap_model(m, ClusterEnv(), torch.device("meta"), engine)
    assert not isinstance(out, DistributedDataParallel)
    assert {p.device.type for p in out.parameters()} == {"meta"}
    assert {b.device.type for b in out.buffers()} == {"meta"}


def test_single_process_keeps_weights():
    torch.manual_seed(0)
    m = Net()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    out = wrap_model(m, ClusterEnv(), CPU, "ddp", WrapOptions(comm_hook="fp16"))
    after = out.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sync_bn_on_cpu_is_refused_on_one_process_as_on_n():
    # once accepted silently on 1 process while 2 processes failed
    with pytest.raises(ConfigError, match=r"SyncBatchNorm needs GPUs.*sync_bn=True \(rt.wrap\)"):
        wrap_model(Net(), ClusterEnv(), CPU, "ddp", WrapOptions(sync_bn=True))
    out = wrap_model(Net(), ClusterEnv(), torch.device("meta"), "ddp", WrapOptions(sync_bn=True))
    assert type(out.bn) is nn.BatchNorm2d  # one process on a device: nothing to synchronise


def test_sync_bn_not_applied_without_ddp():
    # world > 1 but engine none: no DDP, no SyncBatchNorm and no process group needed
    env = ClusterEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
    m = Net()
    out = wrap_model(m, env, CPU, "none", WrapOptions(sync_bn=True))
    assert out is m and type(out.bn) is nn.BatchNorm2d


def test_unknown_comm_hook_lists_choices():
    with pytest.raises(ConfigError) as exc:
        _register_comm_hook(None, "int8")
    assert str(exc.value) == "unknown comm hook 'int8'; choose one of fp16, bf16, powersgd, powersgd-batched, auto"


# ----------------------------------------------------------------------------- wrapping twice

def test_wrapping_a_model_twice_is_one_config_error_at_the_call():
    """Issue 22, row 4: a second rt.wrap used to fail at the first backward (DDP bucket views)."""
    import copy
    from ddpkit.training.runtime import Runtime
    rt = Runtime(ClusterEnv(), CPU, None)
    net = Net()
    wrapped = rt.wrap(net)
    with pytest.raises(ConfigError, match=r"rt.wrap was already called on this Net"):
        rt.wrap(net)
    with pytest.raises(ConfigError, match=r"already called"):
        rt.wrap(wrapped)
    with pytest.raises(ConfigError, match=r"already wrapped \(DataParallel around Net\)"):
        rt.wrap(DataParallel(Net()))
    teacher = rt.wrap(copy.deepcopy(rt.unwrap(wrapped)), "none")  # a copy is a new module
    assert isinstance(teacher, Net) and teacher is not net
