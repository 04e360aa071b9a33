"""CLIP-style two-tower model on paired synthetic "image" and "text" features: symmetric
InfoNCE over the batch with a learnable temperature, AdamW, recall@1 on a held-out set.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, BATCH, EMB = 3, 64, 16


def paired_data(n, seed):
    proj = torch.Generator().manual_seed(5)
    to_img, to_txt = torch.randn(8, 20, generator=proj), torch.randn(8, 12, generator=proj)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 8, generator=g)
    img = z @ to_img + 0.5 * torch.randn(n, 20, generator=g)
    txt = torch.tanh(z @ to_txt) + 0.2 * torch.randn(n, 12, generator=g)
    return TensorDataset(img, txt)


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, EMB))
        self.txt = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, EMB))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, img, txt):
        return (F.normalize(self.img(img), dim=1), F.normalize(self.txt(txt), dim=1),
                self.logit_scale.exp().clamp(max=100))


def gather(t):
    return torch.cat(dist_nn.all_gather(t)) if dist.is_initialized() else t


@torch.no_grad()
def recall_at_1(model, dataset):
    img, txt = dataset.tensors
    a, b, _ = model(img, txt)
    return ((a @ b.t()).argmax(1) == torch.arange(len(img))).float().mean().item()


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = paired_data(768, 0), paired_data(256, 1)
    model = rt.wrap(TwoTower())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    loader = rt.loader(train_set, batch_size=BATCH)

    for epoch in range(1, EPOCHS + 1):
        for img, txt in loader:
            img, txt = rt.to_device(img, txt)
            a, b, scale = model(img, txt)
            labels = torch.arange(len(a), device=a.device) + rt.rank * len(a)
            logits = scale * a @ gather(b).t()
            logits_t = scale * b @ gather(a).t()
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits_t, labels)) / 2
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        r1 = recall_at_1(rt.unwrap(model), val_set)
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} recall@1 {r1:.4f} "
                  f"temp {1 / rt.unwrap(model).logit_scale.exp().item():.6f}")


if __name__ == "__main__":
    main()
