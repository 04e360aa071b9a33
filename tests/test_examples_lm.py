"""The language-model examples of docs/convert.md: the plain script converted with ddpkit, and a
Hugging Face transformers causal LM (built from a config) under `ddpkit run`; 1 process ==
2 processes."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from test_cli import ddpkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def _validation(stdout):
    line = [l for l in stdout.splitlines() if l.startswith("validation loss")][-1]
    return float(line.split()[2].rstrip(",")), int(line.split()[-2])


def test_converted_language_model_scores_the_same_on_1_and_2_processes(tmp_path):
    one = subprocess.run([sys.executable, "examples/lm_ddpkit.py", "--epochs", "1", "--out",
                          str(tmp_path / "one.pt")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    two = ddpkit("run", "--nproc", "2", "examples/lm_ddpkit.py", "--epochs", "1", "--out",
                 str(tmp_path / "two.pt"), timeout=300)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    (loss1, tokens1), (loss2, tokens2) = _validation(one.stdout), _validation(two.stdout)
    assert tokens1 == tokens2  # every validation token once at any world size
    assert loss2 == pytest.approx(loss1, rel=1e-2)  # SGD noise of 1 vs 2 ranks only
    assert two.stdout.count("validation loss") == 1  # printed once, by rank 0


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="needs transformers (pip install 'ddpkit[hf]'; `make test` installs it)")
def test_hugging_face_causal_lm_trains_the_same_on_1_and_2_processes(tmp_path):
    runs = {}
    for n in (1, 2):  # one thread a rank: the same sums on any machine (a reproducible result)
        res = ddpkit("run", "--nproc", str(n), "examples/lm_hf.py", "--max-steps", "8",
                     "--out", str(tmp_path / f"{n}.pt"), timeout=300,
                     env={"OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-3000:]
        runs[n] = torch.load(tmp_path / f"{n}.pt", weights_only=True)
    m1, m2 = runs[1]["metrics"], runs[2]["metrics"]
    assert m1["count"] == m2["count"] > 0
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)
    assert m2["top1"] == pytest.approx(m1["top1"], abs=0.05)
    # 8 AdamW steps of lr 3e-3 move a weight up to 2.4e-2; averaging the gradients over 2
    # ranks instead of 1 batch changes the float32 sums and moves the weights up to 1.7e-5
    # (at 1 thread a rank; 1.2e-5 at 2 threads on 1 process), and Adam's normalisation lifts
    # that in weights of small gradients; without the all-reduce (each rank on its own half)
    # every tensor is 6e-3 to 3.7e-2 off (measured).
    for name, w in runs[1]["weights"].items():
        torch.testing.assert_close(runs[2]["weights"][name], w, rtol=1e-4, atol=1e-4)
