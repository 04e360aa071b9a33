"""Knowledge distillation in one script: first train a wide teacher MLP, then a small student
on a mix of the labels and the teacher's softened predictions (temperature 2).

    python train.py
    ddpkit run --nproc 2 train.py
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

T, ALPHA = 2.0, 0.5
TEACHER_EPOCHS, STUDENT_EPOCHS, BATCH = 2, 2, 64


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = ((x[:, :3].sum(1) > 0).long() * 2 + (x[:, 3] * x[:, 4] > 0).long())
    return TensorDataset(x, y)


def mlp(width):
    return nn.Sequential(nn.Linear(12, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))


def main():
    rt = ddpkit.setup(seed=0)
    train_set, val_set = make_data(768, 0), make_data(256, 1)
    loader = rt.loader(train_set, batch_size=BATCH)

    # stage 1: teacher
    teacher = rt.wrap(mlp(128), engine="none")
    opt_t = torch.optim.Adam(teacher.parameters(), lr=3e-3)
    for epoch in range(1, TEACHER_EPOCHS + 1):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            loss = F.cross_entropy(teacher(x), y)
            opt_t.zero_grad()
            loss.backward()
            opt_t.step()
        res = rt.evaluate(teacher, val_set, topk=(1,))
        rt.print0(f"teacher epoch {epoch} loss {rt.mean(loss):.6f} acc {res['top1'] / 100:.4f}")
    teacher.eval()

    # stage 2: student
    student = rt.wrap(mlp(24))
    opt_s = torch.optim.Adam(student.parameters(), lr=3e-3)
    for epoch in range(1, STUDENT_EPOCHS + 1):
        for x, y in loader:
            x, y = rt.to_device(x, y)
            with torch.no_grad():
                soft = F.softmax(teacher(x) / T, dim=1)
            logits = student(x)
            kd = F.kl_div(F.log_softmax(logits / T, dim=1), soft, reduction="batchmean") * T * T
            loss = ALPHA * kd + (1 - ALPHA) * F.cross_entropy(logits, y)
            opt_s.zero_grad()
            loss.backward()
            opt_s.step()
        res = rt.evaluate(student, val_set, topk=(1,))
        rt.print0(f"epoch {epoch} loss {rt.mean(loss):.6f} val_loss {res['loss']:.6f} "
                  f"acc {res['top1'] / 100:.4f}")


if __name__ == "__main__":
    main()
