"""Built-in models (a small CNN, CIFAR-style ResNets, a small GPT), a name registry and a
parameter summary.

Optional torchvision models are reachable as ``torchvision:<name>``; torchvision is never required.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import ConfigError
from ..base.wrap import unwrap

__all__ = ["SmallCNN", "BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50",
           "GPT", "gpt", "LANGUAGE_MODELS",
           "MODELS", "available_models", "build_model", "model_summary", "format_count"]

TORCHVISION_PREFIX = "torchvision:"


class SmallCNN(nn.Module):
    """A ~30k-parameter conv net for small images (8x8 digits up to 32x32).

    conv-bn-relu x2, max-pool, conv-bn-relu, adaptive avg-pool to 2x2, linear. The BatchNorm
    layers are deliberate: they are what SyncBatchNorm conversion acts on.

    Example::

        model = SmallCNN(in_channels=1, num_classes=10)
        logits = model(torch.randn(4, 1, 8, 8))   # shape (4, 10)
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)  # bias: BN has one
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(2 * width)
        # 2x2 rather than 1x1 keeps coarse layout, which matters for 8x8 digits.
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(2 * width * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = F.relu(self.bn3(self.conv3(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    """Identity when shapes match, else the 1x1 conv + BN projection (ResNet option B)."""
    if stride == 1 and in_planes == out_planes:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
                         nn.BatchNorm2d(out_planes))


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (ResNet-18/34).

    Example::

        block = BasicBlock(64, 128, stride=2)
        y = block(torch.randn(2, 64, 32, 32))     # shape (2, 128, 16, 16)
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(in_planes, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) with a residual connection (ResNet-50).

    Example::

        block = Bottleneck(256, 128, stride=2)
        y = block(torch.randn(2, 256, 32, 32))    # shape (2, 512, 16, 16)
    """

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.shortcut = _shortcut(in_planes, out_planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


Block = Union[Type[BasicBlock], Type[Bottleneck]]


class ResNet(nn.Module):
    """CIFAR-style ResNet: 3x3 stride-1 stem and no max-pool, so 32x32 inputs keep resolution.

    Example::

        model = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=100)   # == resnet18(100)
        logits = model(torch.randn(2, 3, 32, 32))                    # shape (2, 100)
    """

    def __init__(self, block: Block, num_blocks: Sequence[int], num_classes: int = 10,
                 in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.in_planes = 64
        self.layer1 = self._make_layer(block, 64, num_blocks[0], stride=1)
        self.layer2 = self._make_layer(block, 128, num_blocks[1], stride=2)
        self.layer3 = self._make_layer(block, 256, num_blocks[2], stride=2)
        self.layer4 = self._make_layer(block, 512, num_blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        self._init_weights()

    def _make_layer(self, block: Block, planes: int, count: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (count - 1):  # only the first block of a stage downsamples
            layers.append(block(self.in_planes, planes, s))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*layers)

    def _init_weights(self) -> None:
        # He init as in torchvision's ResNet; PyTorch's default conv init is tuned for no ReLU.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR-style ResNet-18 (11.2M parameters with 100 classes).

    Example::

        model = resnet18(num_classes=100)
    """
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_channels)


def resnet34(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR-style ResNet-34.

    Example::

        model = resnet34(num_classes=10)
    """
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes, in_channels)


def resnet50(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR-style ResNet-50 (bottleneck blocks).

    Example::

        model = resnet50(num_classes=100)
    """
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, in_channels)


class Block(nn.Module):
    """One pre-norm transformer decoder block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer language model: token ids ``(B, T)`` in, logits
    ``(B, T, vocab)`` out (GPT-2 layout: learned positions, pre-norm blocks, tied head).

    Example::

        model = GPT(vocab=256, context=128, dim=128, layers=4, heads=4)   # 0.8 M parameters
        logits = model(torch.randint(0, 256, (2, 128)))                   # (2, 128, 256)
    """

    def __init__(self, vocab: int = 256, context: int = 128, dim: int = 128, layers: int = 4,
                 heads: int = 4) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"gpt: dim {dim} must be a multiple of heads {heads}")
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ConfigError(f"gpt: sequences of {t} tokens exceed its context of "
                              f"{self.context}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt(num_classes: int = 256, in_channels: int = 1, context: int = 128) -> GPT:
    """The built-in language model: ``num_classes`` is the vocabulary (256 bytes), 4 blocks of
    width 128 (``in_channels`` is unused: tokens have none).

    Example::

        model = gpt(num_classes=256, context=128)
    """
    return GPT(vocab=num_classes, context=context)


def _small_cnn(num_classes: int = 10, in_channels: int = 1) -> SmallCNN:
    return SmallCNN(in_channels=in_channels, num_classes=num_classes)


#: Built-in models by name; every constructor takes ``num_classes=`` and ``in_channels=``.
#:
#: Example::
#:
#:     model = MODELS["resnet18"](num_classes=10, in_channels=3)
MODELS: Dict[str, Callable[..., nn.Module]] = {
    "small_cnn": _small_cnn,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "gpt": gpt,
}

#: Built-in models that take token sequences (the ``text`` data) rather than images.
LANGUAGE_MODELS = ("gpt",)


def model_key(name: str) -> str:
    """The canonical spelling of a built-in model name: ``"ResNet-18 "`` -> ``"resnet_18"``.

    Example::

        model_key("Small-CNN")   # 'small_cnn'
    """
    return name.strip().lower().replace("-", "_")


def is_torchvision(name: str) -> bool:
    """Whether ``name`` asks for a torchvision model (``torchvision:NAME``).

    Example::

        is_torchvision("torchvision:mobilenet_v3_small")   # True
    """
    return name.strip().lower().startswith(TORCHVISION_PREFIX)


def available_models() -> List[str]:
    """Names accepted by :func:`build_model` (built-ins; torchvision ones go as ``torchvision:X``).

    Example::

        available_models()   # ['resnet18', 'resnet34', 'resnet50', 'small_cnn']
    """
    return sorted(MODELS)


def _build_torchvision(name: str, num_classes: int, in_channels: int) -> nn.Module:
    """``torchvision.models.get_model(name, num_classes=..., weights=None)``: never downloads."""
    try:
        import torchvision
    except ImportError:
        raise ConfigError(f"model 'torchvision:{name}' needs torchvision; "
                          "pip install torchvision, or use one of "
                          f"{', '.join(available_models())}") from None
    if in_channels != 3:  # torchvision stems are hard-wired to RGB input
        raise ConfigError(f"torchvision models take 3 input channels but the data has "
                          f"{in_channels}; use one of {', '.join(available_models())}")
    get_model = getattr(torchvision.models, "get_model", None)
    if get_model is None:
        raise ConfigError("torchvision models need torchvision>=0.14 (for get_model); "
                          "pip install -U torchvision")
    try:
        return get_model(name, num_classes=num_classes, weights=None)
    except ValueError as exc:  # unknown name; the list is long, so point at it instead
        raise ConfigError(f"torchvision has no model {name!r} ({exc}); see "
                          "torchvision.models.list_models()") from None


def build_model(name: str, num_classes: int, in_channels: int, **options: Any) -> nn.Module:
    """A freshly initialised model by name: a built-in, or ``torchvision:<name>``.

    Example::

        build_model("small_cnn", num_classes=10, in_channels=1)
        build_model("torchvision:mobilenet_v3_small", num_classes=10, in_channels=3)
    """
    if is_torchvision(name):
        return _build_torchvision(name.strip()[len(TORCHVISION_PREFIX):], num_classes, in_channels)
    key = model_key(name)
    if key not in MODELS:
        raise ConfigError(f"unknown model {name!r}; valid models: "
                          f"{', '.join(available_models())}, or torchvision:<name>")
    return MODELS[key](num_classes=num_classes, in_channels=in_channels, **options)


def format_count(n: float) -> str:
    """A parameter count the way Lightning prints it: ``'11.2 M'``, ``'45.3 K'``, ``'123 K'``.

    Example::

        format_count(11_220_132)   # '11.2 M'
    """
    units = ["", "K", "M", "B", "T"]
    value, unit = float(n), 0
    # 999.5 K prints as "1.0 M", never as "1000 K".
    while abs(value) >= 999.5 and unit < len(units) - 1:
        value, unit = value / 1000, unit + 1
    if unit == 0:
        return f"{int(value)}"
    return f"{value:.1f} {units[unit]}" if abs(value) < 99.95 else f"{value:.0f} {units[unit]}"


def _numel(params: Iterable[torch.Tensor]) -> Tuple[int, int]:
    """(trainable, frozen) element counts; lazy parameters are not yet sized, so count 0."""
    trainable = frozen = 0
    for p in params:
        if isinstance(p, nn.parameter.UninitializedParameter):
            continue
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def _table(rows: List[Tuple[str, ...]]) -> List[str]:
    """Left-aligned ``a | b | c`` lines with a dashed rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return [lines[0], "-" * max(len(line) for line in lines)] + lines[1:]


def model_summary(model: nn.Module) -> str:
    """A Lightning-style table of the top-level children and the parameter totals.

    DDP / DataParallel / torch.compile wrappers are unwrapped first. The size counts the bytes
    of parameters and buffers (so BatchNorm running stats are included), divided by 1e6.

    Example::

        print(model_summary(resnet18(100)))
        # ...
        # 11.2 M    Total params
        # 44.919    Total estimated model params size (MB)
    """
    model = unwrap(model)
    children = list(model.named_children()) or [("model", model)]  # a leaf is its own row
    rows = [("", "Name", "Type", "Params")]
    for idx, (name, child) in enumerate(children):
        rows.append((str(idx), name, type(child).__name__, format_count(sum(_numel(
            child.parameters())))))
    trainable, frozen = _numel(model.parameters())
    tensors = [t for t in list(model.parameters()) + list(model.buffers())
               if not isinstance(t, nn.parameter.UninitializedTensorMixin)]
    size_mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    rule = _table(rows)[1]
    totals = [(format_count(trainable), "Trainable params"),
              (format_count(frozen), "Non-trainable params"),
              (format_count(trainable + frozen), "Total params"),
              (f"{size_mb:,.3f}", "Total estimated model params size (MB)")]
    return "\n".join(_table(rows) + [rule] + [f"{a:<10}{b}" for a, b in totals])
