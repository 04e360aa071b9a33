"""A rank that leaves right after its last collective, with a DDP model still holding the group.

This is the exit that aborted with "terminate called without an active exception" in CI
(see ddpkit.env.dist._shutdown_at_exit). Run by tests/test_multiprocess.py as plain processes.
"""
import torch
from torch import nn

import ddpkit

rt = ddpkit.setup(seed=0)
model = rt.wrap(nn.Linear(100, 10))
model(torch.randn(4, 100)).sum().backward()
for _ in range(20):
    t = torch.ones(1000) * rt.rank
    rt.reduce(t)
    del t   # gloo's worker may now hold the last reference to this tensor
if rt.is_main:
    import time
    time.sleep(0.05)  # the other rank leaves first, as in examples/train_ddpkit.py
