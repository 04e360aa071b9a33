"""Precision policies on CPU: refusals, autocast, clipping step, state round trip.

The CUDA fp16 path is only checked for its configuration logic: this CPU build has no GPU.
"""
import warnings

import pytest
import torch
from torch import nn

from ddpkit.base.errors import ConfigError
from ddpkit.training.precision import POLICIES, Precision

CPU = torch.device("cpu")


def test_each_policy_named_is_an_autocast_dtype_or_says_what_it_needs():
    # every name the flag offers is a working policy on CPU, or one line saying what it needs
    dtypes = {}
    for policy in POLICIES:
        try:
            dtypes[policy] = Precision(policy, CPU).dtype
        except ConfigError as exc:
            assert policy == "fp16" and "needs a CUDA device" in str(exc)
    assert dtypes == {"fp32": None, "bf16": torch.bfloat16}
    with pytest.raises(ConfigError, match="unknown precision 'fp8'; choose one of " +
                       ", ".join(POLICIES)):
        Precision("fp8", CPU)


def test_default_is_fp32_on_cpu():
    p = Precision()
    assert (p.policy, p.device, p.dtype, p.scaler) == ("fp32", CPU, None, None)


def test_dtypes():
    assert Precision("bf16", CPU).dtype is torch.bfloat16
    assert Precision("fp32", CPU).dtype is None


def test_fp16_on_cpu_refused_with_bf16_suggestion():
    with pytest.raises(ConfigError) as exc:
        Precision("fp16", CPU)
    msg = str(exc.value)
    assert msg.startswith("fp16 mixed precision needs a CUDA device")
    assert msg.endswith("use --precision bf16 on CPU")


@pytest.mark.parametrize("policy", ["fp8", "FP16", "float32", ""])
def test_unknown_policy(policy):
    with pytest.raises(ConfigError) as exc:
        Precision(policy, CPU)
    assert str(exc.value) == f"unknown precision {policy!r}; choose one of fp32, bf16, fp16"


def test_bf16_autocast_on_cpu():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    prec = Precision("bf16", CPU)
    with prec.autocast():
        assert torch.is_autocast_enabled("cpu")
        out = layer(x)
    assert out.dtype is torch.bfloat16
    assert layer.weight.dtype is torch.float32  # parameters stay fp32
    assert not torch.is_autocast_enabled("cpu")
    assert torch.allclose(out.float(), layer(x), atol=0.05)


def test_fp32_autocast_is_a_no_op():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with Precision("fp32", CPU).autocast():
        assert not torch.is_autocast_enabled("cpu")
        out = layer(x)
    assert out.dtype is torch.float32
    assert torch.equal(out, layer(x))


def test_fp32_backward_is_plain_backward():
    w = nn.Parameter(torch.tensor([2.0]))
    Precision("fp32", CPU).backward((w * 3).sum())
    assert torch.equal(w.grad, torch.tensor([3.0]))


def _param_with_grad(grad):
    p = nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad)
    return p


def test_step_with_clip_norm_clips_and_returns_norm():
    p = _param_with_grad([3.0, 4.0, 0.0, 0.0])  # norm 5
    opt = torch.optim.SGD([p], lr=1.0)
    norm = Precision("fp32", CPU).step(opt, clip_norm=1.0, parameters=[p])
    assert norm == 5.0
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6): the step is the unit-norm gradient
    assert torch.allclose(p.detach(), torch.tensor([-0.6, -0.8, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(p.grad.norm(), torch.tensor(1.0), atol=1e-6)


def test_step_clip_uses_optimizer_params_when_none_given():
    p = _param_with_grad([0.0, 6.0, 8.0])  # norm 10
    q = _param_with_grad([0.0])
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.5)
    norm = Precision("bf16", CPU).step(opt, clip_norm=2.0)
    assert norm == 10.0
    assert torch.allclose(p.detach(), torch.tensor([0.0, -0.6, -0.8]), atol=1e-6)


def test_step_accepts_a_parameter_generator():
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    model.weight.grad = torch.tensor([[30.0, 40.0]])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    norm = Precision("fp32", CPU).step(opt, clip_norm=5.0, parameters=model.parameters())
    assert norm == 50.0
    assert torch.allclose(model.weight.detach(), torch.tensor([[-3.0, -4.0]]), atol=1e-5)


def test_step_below_clip_norm_leaves_gradient():
    p = _param_with_grad([0.3, 0.4])
    opt = torch.optim.SGD([p], lr=1.0)
    norm = Precision("fp32", CPU).step(opt, clip_norm=1.0, parameters=[p])
    assert norm == pytest.approx(0.5)
    assert torch.allclose(p.detach(), torch.tensor([-0.3, -0.4]))


def test_step_without_clip_returns_none_and_steps():
    p = _param_with_grad([1.0, -2.0])
    opt = torch.optim.SGD([p], lr=0.5)
    assert Precision("fp32", CPU).step(opt) is None
    assert torch.equal(p.detach(), torch.tensor([-0.5, 1.0]))


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_state_dict_round_trip(policy):
    state = Precision(policy, CPU).state_dict()
    assert state == {"policy": policy, "scaler": None}
    other = Precision(policy, CPU)
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_load_state_dict_policy_mismatch_names_both():
    with pytest.raises(ConfigError) as exc:
        Precision("fp32", CPU).load_state_dict({"policy": "bf16", "scaler": None})
    assert str(exc.value) == ("checkpoint was trained with precision bf16, this run uses fp32; "
                              "pass --precision bf16")


def test_load_state_dict_without_policy_rejected():
    with pytest.raises(ConfigError, match="checkpoint was trained with precision None, this run uses bf16"):
        Precision("bf16", CPU).load_state_dict({})


# --------------------------------------------------------------------------- CUDA configuration


def test_bf16_on_cuda_without_bf16_support_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ConfigError) as exc:
        Precision("bf16", torch.device("cuda"))
    assert str(exc.value) == "this GPU does not support bf16; use --precision fp16"


def test_bf16_on_cuda_with_support_has_no_scaler(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    p = Precision("bf16", torch.device("cuda", 1))
    assert (p.dtype, p.scaler, p.device) == (torch.bfloat16, None, torch.device("cuda", 1))


def test_fp16_on_cuda_creates_a_grad_scaler():
    if torch.cuda.is_available():  # pragma: no cover - this suite runs on CPU
        p = Precision("fp16", torch.device("cuda"))
        assert p.scaler.is_enabled()
    else:
        # Without a GPU torch builds the scaler but disables it, saying so.
        with pytest.warns(UserWarning, match="CUDA is not available"):
            p = Precision("fp16", torch.device("cuda"))
        assert not p.scaler.is_enabled()
    assert isinstance(p.scaler, torch.amp.GradScaler)
    assert p.dtype is torch.float16
    state = p.state_dict()
    assert state["policy"] == "fp16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Precision("fp16", torch.device("cuda")).load_state_dict(state)


def test_bf16_on_a_cpu_without_native_bf16_warns_once_clearly(monkeypatch):
    from ddpkit.env import machine
    monkeypatch.setattr(machine, "cpu_info", lambda: {"model": "x", "flags": ["avx2", "fma"]})
    with pytest.warns(UserWarning, match=r"^bf16 on this CPU is emulated .* use --precision fp32"):
        Precision("bf16", CPU)
    monkeypatch.setattr(machine, "cpu_info", lambda: {"model": "x", "flags": ["amx_bf16"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Precision("bf16", CPU)   # native bf16: no warning
