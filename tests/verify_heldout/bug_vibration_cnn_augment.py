"""1-D CNN on synthetic vibration signals with on-the-fly augmentation in the Dataset
(random circular shift, gain and additive noise that shrinks over epochs), 2 loader workers.

    python train.py
    ddpkit run --nproc 2 train.py
"""
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

import ddpkit

EPOCHS, BATCH, LENGTH = 3, 32, 64


def make_signals(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    t = np.arange(LENGTH) / LENGTH
    x = np.sin(2 * np.pi * (2 + 2 * y)[:, None] * t[None, :] + rng.uniform(0, 6.3, (n, 1)))
    x += 0.3 * rng.standard_normal((n, LENGTH))
    return x.astype(np.float32), y


class AugmentedSignals(Dataset):
    def __init__(self, x, y, seed=0):
        self.x, self.y, self.seed, self.epoch = x, y, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.y)

    def __getitem__(self, idx):
        rng = np.random
        sig = np.roll(self.x[idx], int(rng.uniform(0, LENGTH)))
        sig = sig * rng.uniform(0.8, 1.2)
        sig = sig + rng.normal(0.0, 0.3 / (1 + self.epoch), LENGTH)
        return torch.from_numpy(sig.astype(np.float32)).unsqueeze(0), int(self.y[idx])


class SignalCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(1, 16, 7, padding=3)
        self.conv2 = nn.Conv1d(16, 32, 5, padding=2)
        self.fc = nn.Linear(32, 3)

    def forward(self, x):
        x = F.max_pool1d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(x.mean(-1))


def main():
    rt = ddpkit.setup(seed=0)
    x_tr, y_tr = make_signals(384, 0)
    x_va, y_va = make_signals(192, 1)
    train_set = AugmentedSignals(x_tr, y_tr, seed=0)
    val_set = TensorDataset(torch.from_numpy(x_va).unsqueeze(1), torch.from_numpy(y_va))
    model = rt.wrap(SignalCNN())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = rt.loader(train_set, batch_size=BATCH, num_workers=2, persistent_workers=False)

    for epoch in range(1, EPOCHS + 1):
        train_set.set_epoch(epoch)
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
