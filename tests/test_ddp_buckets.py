"""DDP's first step all-reduced in the buckets of later steps (ddpkit.engines.buckets): on 3
ranks a run resumed from its weights and optimizer ends bitwise where the uninterrupted run
ends. Plain DDP reduces every start's first step in one bucket: on 3 ranks the ring's partial
sums then differ (a 2-rank test cannot see it: a + b = b + a)."""
import copy
import json
import os

import torch
from torch import nn

import ddpkit
import ddpkit.engines.ddp as ddp_engine

STEPS, STOP = 6, 3
CASES = {"defaults": {}, "1 MB buckets": {"bucket_cap_mb": 1}}
PIECES = {"defaults": [6], "1 MB buckets": [2, 4]}   # parameters per rebuilt bucket


def _model():
    # 3.3 MB of gradients. At the defaults DDP's rebuilt bucket holds them all, in the order
    # they became ready, which is not the first step's order; with bucket_cap_mb=1 they are
    # rebuilt into two buckets, the last two layers' and the first layer's
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4000), nn.ReLU(), nn.Linear(4000, 200), nn.ReLU(),
                         nn.Linear(200, 4))


def _train(rt, model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rt.rank)  # each rank its own batch
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _fresh(rt, options):
    model = rt.wrap(_model(), **options)
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _uninterrupted_and_resumed(rt, options):
    whole, opt = _fresh(rt, options)
    _train(rt, whole, opt, range(STEPS))
    first, opt = _fresh(rt, options)
    _train(rt, first, opt, range(STOP))
    saved = copy.deepcopy((first.module.state_dict(), opt.state_dict()))
    resumed, opt = _fresh(rt, options)   # a new DDP, as a restarted process builds
    resumed.module.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    _train(rt, resumed, opt, range(STOP, STEPS))
    diff = max((a - b).abs().max().item()
               for a, b in zip(whole.parameters(), resumed.parameters()))
    state = resumed._comm_hooks[0][1] if resumed._comm_hooks else None
    return diff, getattr(state, "matched", None), [len(s) for s in getattr(state, "seen", [])]


def _ranks(out):
    rt = ddpkit.setup(seed=0, deterministic=True, engine="ddp")
    try:
        got = {name: _uninterrupted_and_resumed(rt, options) for name, options in CASES.items()}
        ddp_engine.install_steady_buckets = lambda ddp: None  # plain DDP, as before
        got.update({f"plain {name}": _uninterrupted_and_resumed(rt, options)
                    for name, options in CASES.items()})
        with open(os.path.join(out, f"rank{rt.rank}.json"), "w") as f:
            json.dump(got, f)
    finally:
        rt.shutdown()


def test_a_resume_on_3_ranks_is_bitwise_with_ddp_buckets_over_1_mb(tmp_path):
    ddpkit.launch(_ranks, 3, str(tmp_path), timeout=180)
    for rank in range(3):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in CASES:
            diff, matched, pieces = got[name]
            assert diff == 0.0, f"{name}, rank {rank}: resumed weights differ by {diff}: {got}"
            assert matched is True, f"{name}: DDP's rebuilt buckets were not the first step's"
            assert sorted(pieces) == PIECES[name], (name, pieces)
            # the premise: without the hook the same runs differ (if a newer torch reduces the
            # first step in its later buckets itself, this fails and the hook can go)
            assert got[f"plain {name}"][0] > 0.0, (name, got)
