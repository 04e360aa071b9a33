"""A planted bug for `ddpkit verify`: a language-model loss averaged over each rank's tokens, when
sequences have different numbers of padding tokens: on N processes the gradient is a mean of
per-rank means, not the mean over every token.

    ddpkit verify --nproc 2 examples/broken/mean_of_means.py   # FAIL [mean-of-means]
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

rt = ddpkit.setup(seed=0)
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 16, (512, 12), generator=g)
lengths = torch.randint(2, 13, (512,), generator=g)
targets = torch.where(torch.arange(12) < lengths[:, None], tokens.roll(-1, 1), -100)  # padding
model = rt.wrap(nn.Sequential(nn.Embedding(16, 32), nn.Linear(32, 16)))
opt = torch.optim.SGD(model.parameters(), lr=0.5)
loader = rt.loader(TensorDataset(tokens, targets), 32)
for epoch in range(2):
    for x, y in loader:
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())  # this rank's mean
        opt.zero_grad()
        loss.backward()
        opt.step()
