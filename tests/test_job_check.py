"""ddpkit.job.check: optional packages a request needs are named before any worker starts.

(The other impossible requests, end to end through `ddpkit train`, are in test_cli.py.)"""
import importlib.util
import sys

import pytest

from ddpkit.errors import ConfigError
from ddpkit.job.check import check_config
from ddpkit.job.config import TrainConfig


def test_a_torchvision_model_without_torchvision_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^model 'torchvision:resnet18' needs torchvision; "
                                          r"pip install torchvision"):
        check_config(TrainConfig(model="torchvision:resnet18"), 2, cuda=False)


def test_an_image_folder_without_pillow_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ConfigError, match=r"^dataset 'imagefolder' needs Pillow .* pip install "
                                          r"pillow$"):
        check_config(TrainConfig(data="imagefolder", data_dir=str(tmp_path)), 2, cuda=False)
