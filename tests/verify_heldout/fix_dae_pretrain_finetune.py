"""Two stages: pretrain an encoder as a denoising autoencoder once (saved to disk), then
fine-tune encoder + classifier on the labelled set with AdamW.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import os
import shutil
import tempfile

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

DIM, HID = 16, 32


def encoder():
    return nn.Sequential(nn.Linear(DIM, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU())


def pretrain_encoder(steps=60):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1024, 4, generator=g) @ torch.randn(4, DIM, generator=g)
    enc, dec = encoder(), nn.Linear(HID, DIM)
    opt = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()), lr=3e-3)
    for _ in range(steps):
        noisy = x + 0.3 * torch.randn(x.shape, generator=g)
        loss = F.mse_loss(dec(enc(noisy)), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return enc.state_dict()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = encoder()
        self.head = nn.Linear(HID, 3)

    def forward(self, x):
        return self.head(self.encoder(x))


def labelled(n, seed):
    g = torch.Generator().manual_seed(7)
    basis = torch.randn(4, DIM, generator=g)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 4, generator=g)
    y = (z[:, 0] > 0.5).long() + (z[:, 1] > 0).long()
    return TensorDataset(z @ basis + 0.3 * torch.randn(n, DIM, generator=g), y)


def main():
    rt = ddpkit.setup(seed=0)
    workdir = rt.broadcast_object(tempfile.mkdtemp(prefix="warm_start_") if rt.is_main else None)
    ckpt_path = os.path.join(workdir, "encoder.pt")
    if rt.is_main:
        torch.save(pretrain_encoder(), ckpt_path)
    rt.barrier()

    train_set, val_set = labelled(384, 1), labelled(192, 2)
    model = rt.wrap(Classifier())
    rt.unwrap(model).encoder.load_state_dict(torch.load(ckpt_path))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    loader = rt.loader(train_set, batch_size=32)

    for epoch in range(1, 4):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val = rt.evaluate(model, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {val['loss']:.6f} "
                  f"acc {val['top1'] / 100:.4f}")

    rt.barrier()
    if rt.is_main:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
