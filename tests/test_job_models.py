"""Tests for ddpkit.job.models: shapes, parameter counts, the name registry and model_summary.

Everything runs on tiny CPU batches; no training happens here.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from ddpkit.base.errors import ConfigError
from ddpkit.job.models import (MODELS, SmallCNN, available_models, build_model, format_count,
                           model_summary, resnet18, resnet34, resnet50)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_small_cnn_forward_on_digits_shape() -> None:
    model = SmallCNN(in_channels=1, num_classes=10)
    assert model(torch.randn(4, 1, 8, 8)).shape == (4, 10)


def test_small_cnn_handles_32x32_rgb_and_is_small() -> None:
    model = SmallCNN(in_channels=3, num_classes=7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    assert n_params(SmallCNN()) < 100_000


def test_small_cnn_has_batchnorm_that_converts_to_syncbn() -> None:
    model = SmallCNN()
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert any(isinstance(m, nn.SyncBatchNorm) for m in synced.modules())


def test_resnet18_100_classes_param_count_and_forward() -> None:
    model = resnet18(num_classes=100)
    assert 11_100_000 < n_params(model) < 11_300_000
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 100)


@pytest.mark.parametrize("factory, low, high", [(resnet34, 21.2e6, 21.4e6),
                                                 (resnet50, 23.4e6, 23.6e6)])
def test_deeper_resnets_param_counts_and_forward(factory, low, high) -> None:
    model = factory(num_classes=10)
    assert low < n_params(model) < high
    model.eval()
    with torch.no_grad():  # 16x16 keeps the bottleneck forward cheap; the pool is adaptive
        assert model(torch.randn(1, 3, 16, 16)).shape == (1, 10)


def test_resnet_stem_is_cifar_style_and_accepts_one_channel() -> None:
    model = resnet18(num_classes=10, in_channels=1)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 1, 8, 8)).shape == (1, 10)


def test_available_models_lists_builtins() -> None:
    assert available_models() == sorted(MODELS)
    assert {"small_cnn", "resnet18", "resnet34", "resnet50"} <= set(available_models())


def test_build_model_builtin_and_name_normalisation() -> None:
    model = build_model("small_cnn", num_classes=5, in_channels=3)
    assert isinstance(model, SmallCNN)
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 5)
    assert isinstance(build_model("Small-CNN", 10, 1), SmallCNN)


def test_build_model_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as err:
        build_model("resnet19", num_classes=10, in_channels=3)
    message = str(err.value)
    assert "resnet19" in message and "\n" not in message
    for name in available_models():
        assert name in message


def test_build_model_torchvision_missing_says_pip_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision` fail
    with pytest.raises(ConfigError, match="pip install torchvision"):
        build_model("torchvision:mobilenet_v3_small", num_classes=10, in_channels=3)


def fake_torchvision(monkeypatch, calls: list) -> None:
    """Install a stand-in torchvision whose get_model records its arguments."""
    def get_model(name, **kwargs):
        calls.append((name, kwargs))
        if name != "tiny":
            raise ValueError(f"Unknown model {name}")
        return nn.Linear(3, kwargs["num_classes"])

    module = types.ModuleType("torchvision")
    module.models = types.SimpleNamespace(get_model=get_model)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", module)


def test_build_model_torchvision_passes_no_weights(monkeypatch) -> None:
    calls: list = []
    fake_torchvision(monkeypatch, calls)
    model = build_model("torchvision:tiny", num_classes=4, in_channels=3)
    assert isinstance(model, nn.Linear) and model.out_features == 4
    assert calls == [("tiny", {"num_classes": 4, "weights": None})]


def test_build_model_torchvision_errors_are_config_errors(monkeypatch) -> None:
    fake_torchvision(monkeypatch, [])
    with pytest.raises(ConfigError, match="list_models"):
        build_model("torchvision:nope", num_classes=4, in_channels=3)
    with pytest.raises(ConfigError, match="3 input channels"):
        build_model("torchvision:tiny", num_classes=4, in_channels=1)


@pytest.mark.parametrize("count, text", [(0, "0"), (999, "999"), (1000, "1.0 K"),
                                         (45_321, "45.3 K"), (123_456, "123 K"),
                                         (999_600, "1.0 M"), (11_220_132, "11.2 M"),
                                         (2_500_000_000, "2.5 B")])
def test_format_count(count: int, text: str) -> None:
    assert format_count(count) == text


def test_model_summary_rows_and_totals() -> None:
    text = model_summary(resnet18(num_classes=100))
    for needle in ("Name", "Type", "Params", "Trainable params", "Non-trainable params",
                   "Total params", "Total estimated model params size (MB)"):
        assert needle in text
    assert "layer4" in text and "Sequential" in text
    total_line = next(line for line in text.splitlines() if line.endswith("Total params"))
    assert total_line.startswith("11.2 M")
    size_line = next(line for line in text.splitlines() if "size (MB)" in line)
    assert 44.0 < float(size_line.split()[0]) < 46.0  # params + BN buffers, float32


def test_model_summary_counts_frozen_params() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)
    lines = model_summary(model).splitlines()
    assert any(line.startswith("22 ") and "Trainable" in line for line in lines)
    assert any(line.startswith("110 ") and "Non-trainable" in line for line in lines)
    assert any(line.startswith("132 ") and "Total params" in line for line in lines)


def test_model_summary_unwraps_data_parallel() -> None:
    model = SmallCNN()
    wrapped = nn.DataParallel(model)  # on CPU it just holds .module
    assert model_summary(wrapped) == model_summary(model)
    assert "DataParallel" not in model_summary(wrapped)


def test_model_summary_unwraps_ddp_without_process_group() -> None:
    model = SmallCNN()
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp)  # a bare shell: enough to exercise the unwrapping
    ddp.module = model
    assert model_summary(ddp) == model_summary(model)


def test_model_summary_of_leaf_module() -> None:
    text = model_summary(nn.Linear(3, 4))
    assert "Linear" in text and "16" in text
