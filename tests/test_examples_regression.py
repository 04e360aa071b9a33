"""examples/regression_ddpkit.py under `ddpkit run`: a user's own loop, then one rt.evaluate whose
r2 is the same on 1 and 2 processes and equals r2 computed by hand from the saved weights."""
import importlib.util
import os

import pytest
import torch

from test_cli import ddpkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join("examples", "regression_ddpkit.py")
pytestmark = pytest.mark.slow


def _example():
    spec = importlib.util.spec_from_file_location("regression_ddpkit", os.path.join(ROOT, SCRIPT))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _validation(stdout):
    """{'mse': ..., 'mae': ..., 'r2': ..., 'rows': ...} from 'validation mse M mae A r2 R on N rows'."""
    words = [l for l in stdout.splitlines() if l.startswith("validation mse")][-1].split()
    return {"mse": float(words[2]), "mae": float(words[4]), "r2": float(words[6]),
            "rows": int(words[8])}


def _r2_by_hand(example, weights):
    """Single process, float64, no sklearn: 1 - SSE / SST over every validation row."""
    model = example.make_model()
    model.load_state_dict(weights)
    x, y = example.make_data()[1].tensors
    with torch.no_grad():
        pred = model.eval()(x).squeeze(1).double()
    y = y.double()
    return float(1 - ((pred - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()), len(y)


def test_regression_example_scores_the_same_on_1_and_2_processes(tmp_path):
    example, runs = _example(), {}
    for n in (1, 2):
        out = tmp_path / f"{n}.pt"
        res = ddpkit("run", "--nproc", str(n), SCRIPT, "--epochs", "3", "--out", str(out),
                     timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.count("validation mse") == 1  # printed once, by rank 0
        runs[n] = _validation(res.stdout), torch.load(out, weights_only=True)
    for printed, weights in runs.values():
        r2, rows = _r2_by_hand(example, weights)
        assert printed["rows"] == rows == 601  # every row once, at any world size
        assert printed["r2"] == pytest.approx(r2, abs=1e-8)  # 10 decimals; float32 forwards
    assert runs[2][0]["r2"] == pytest.approx(runs[1][0]["r2"], abs=1e-6)  # float rounding only
    assert runs[1][0]["r2"] > 0.9  # and it learns
