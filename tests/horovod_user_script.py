"""A user script under horovodrun: ddpkit.setup() detects Horovod (used by test_engines_horovod.py)."""
import sys, torch, ddpkit
from torch import nn
rt = ddpkit.setup(seed=0)
model = rt.wrap(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if sys.argv[1] == "wrapped":
    opt = rt.optimizer(opt, model)
x = torch.randn(8, 4) + rt.rank
model(x).sum().backward(); opt.step()
w = ddpkit.gather_object(model.weight.detach().clone())
rt.print0("ranks agree:", all(torch.equal(w[0], v) for v in w))
rt.shutdown()
