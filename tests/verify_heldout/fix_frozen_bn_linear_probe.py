"""Linear probe / fine-tune of a frozen convolutional backbone with BatchNorm (its weights and
BatchNorm statistics prepared once up front), only a new classification head is trained.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, BATCH, LR = 3, 32, 0.05


def make_textures(n, seed, size=12):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    xs = torch.arange(size).float()
    freq = (1 + y).float()[:, None, None] * 0.5
    horiz = (y % 2 == 0)[:, None, None]
    grid = torch.where(horiz, xs[None, :, None].expand(n, size, size),
                       xs[None, None, :].expand(n, size, size))
    img = torch.sin(freq * grid) + 0.6 * torch.randn(n, size, size, generator=g)
    return TensorDataset(img.unsqueeze(1), y)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.body(x)


def pretrained_backbone(calib_images):
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(123)
        backbone = Backbone()
    backbone.train()
    with torch.no_grad():
        for m in backbone.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = None
        for chunk in calib_images.split(128):
            backbone(chunk)
    for p in backbone.parameters():
        p.requires_grad_(False)
    return backbone.eval()


class Probe(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_textures(384, 0), make_textures(192, 1)
    model = rt.wrap(Probe(pretrained_backbone(train_set.tensors[0])))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR,
                                momentum=0.9)
    loader = rt.loader(train_set, batch_size=BATCH)

    for epoch in range(1, EPOCHS + 1):
        model.train()
        rt.unwrap(model).backbone.eval()
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val = rt.evaluate(model, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"acc {val['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
