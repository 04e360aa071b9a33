"""``rt.slices`` (ddpkit/data/slices.py): a token tensor read in BPTT slices, split by column
over the ranks, its place kept by the checkpointer; examples/lm_bptt.py (word_language_model's
shape: no Dataset, the hidden state carried across slices and kept per rank) resumes bitwise
after a kill -9 mid-epoch."""
import os

import pytest
import torch

from ddpkit.base.errors import ConfigError
from ddpkit.data.slices import SliceLoader

import forkrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = torch.arange(1000)


def test_the_ranks_read_together_what_one_process_reads():
    one = list(SliceLoader(TOKENS, batch_size=4, bptt=7))
    ranks = [list(SliceLoader(TOKENS, batch_size=4, bptt=7, rank=r, world=2)) for r in (0, 1)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == -(-(250 - 1) // 7)
    for k, (x, y) in enumerate(one):
        assert torch.equal(torch.cat([ranks[0][k][0], ranks[1][k][0]], dim=1), x)
        assert torch.equal(torch.cat([ranks[0][k][1], ranks[1][k][1]], dim=1), y)
    x, y = one[0]
    assert torch.equal(x[:, 0], torch.arange(7)) and torch.equal(y[:, 0], torch.arange(1, 8))
    assert torch.equal(x[:, 1], torch.arange(250, 257))  # column 1: the second quarter
    assert one[-1][0].shape == (249 - 35 * 7, 4)  # the short last slice


def test_the_position_resumes_with_the_next_slice_and_the_epochs_go_on():
    loader = SliceLoader(TOKENS, batch_size=4, bptt=7)
    seen = []
    for i, batch in enumerate(loader):
        seen.append(batch)
        if i == 9:
            break
    state = loader.state_dict()
    assert state == {"epoch": 0, "samples_done": 70} and not loader.at_last_batch
    resumed = SliceLoader(TOKENS, batch_size=4, bptt=7)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert torch.equal(rest[0][0], list(SliceLoader(TOKENS, 4, 7))[10][0])
    assert len(seen) + len(rest) == len(loader)
    assert resumed.at_last_batch and resumed.state_dict() == {"epoch": 1, "samples_done": 0}
    assert len(list(resumed)) == len(loader) and resumed.epoch == 1


def test_bad_shapes_are_one_line():
    with pytest.raises(ConfigError, match="split evenly over 2 ranks"):
        SliceLoader(TOKENS, batch_size=3, bptt=5, world=2)
    with pytest.raises(ConfigError, match="1-D tensor"):
        SliceLoader(TOKENS.view(10, 100), batch_size=2, bptt=5)
    with pytest.raises(ConfigError, match="fewer than 2 rows"):
        SliceLoader(torch.arange(5), batch_size=4, bptt=5)


def _lm(out, *launch):
    res = forkrun.ddpkit("run", "--nproc", "2", *launch, "examples/lm_bptt.py", "--epochs", "2",
                         "--out", str(out), "--every", "5", "--eval-every", "6", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res, torch.load(out / "final.pt", weights_only=True)


@pytest.mark.slow
def test_a_bptt_language_model_killed_mid_epoch_resumes_bitwise(tmp_path):
    _, reference = _lm(tmp_path / "reference")
    # rank 1 killed right after its 7th optimizer step; the checkpoint of step 5 holds each
    # rank's hidden state and the row the slices had reached; the resumed run then crosses
    # into epoch 2, whose streams start afresh
    res, resumed = _lm(tmp_path / "killed", "--max-restarts", "1", "tests/kill_at_step.py",
                       "--rank", "1", "--step", "7", "--")
    assert "resumed from" in res.stdout + res.stderr and "at step 5 (epoch 1, mid-epoch)" in \
        res.stdout + res.stderr
    assert resumed["step"] == reference["step"] == 2 * 176
    assert resumed["evals"] == reference["evals"] and resumed["val"] == reference["val"]
    for name, value in reference["model"].items():
        assert torch.equal(resumed["model"][name], value), name
