"""ddpkit bench: pure parts (rows, statistics, table) and a smoke run of ``--quick``.

Speed is never asserted: figures only have to be present, positive and consistent.
"""
import json
import os
import subprocess
import sys

import pytest

from ddpkit.bench import ROWS, BenchConfig, parse_rows, plan_row, skip_reason
from ddpkit.bench.rows import DEFAULT_ROWS
from ddpkit.bench.report import (cpu_share, efficiency, median, percentile, render_table,
                                 repeat_figures, summarize)
from ddpkit.base.errors import ConfigError

CPU_CAPS = {"cuda_count": 0, "horovod_missing": "horovod is not installed", "native_bf16": False,
            "bf16_slowdown": 9.0}


def test_parse_rows_keeps_order_and_drops_duplicates():
    assert parse_rows(" ddp,single-1t ,ddp,") == ["ddp", "single-1t"]


def test_unknown_row_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        parse_rows("ddp,warp-drive")
    text = str(err.value)
    assert "warp-drive" in text and "single-1t" in text and "zero" in text
    assert "\n" not in text


def test_median_and_p95_match_numpy_definitions():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    assert percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_efficiency_arithmetic():
    assert efficiency(95.0, 2, 50.0) == pytest.approx(0.95)
    assert efficiency(50.0, 1, 50.0) == 1.0
    with pytest.raises(ValueError):
        efficiency(1.0, 0, 1.0)


def test_repeat_figures_take_the_slowest_rank_per_step():
    figs = repeat_figures([[1.0, 2.0, 1.0], [1.5, 1.0, 1.0]], global_batch=100)
    assert figs["step_ms_median"] == pytest.approx(1500.0)  # steps: 1.5, 2.0, 1.0
    assert figs["images_s"] == pytest.approx(100 / 1.5)


def test_cpu_share_is_cpu_seconds_per_wall_second_and_thread():
    assert cpu_share([[2.0, 2.0]], [[1.0, 1.0]], [1]) == pytest.approx(0.5)
    assert cpu_share([[1.0], [1.0]], [[2.0], [1.0]], [2, 1]) == pytest.approx(1.0)


def _record(name, ips_per_round, workers=2, status="ok", reason=None):
    reps = [{"round": i, "images_s": v, "step_ms_median": 1000.0, "step_ms_p95": 1100.0,
             "peak_mb": [100.0, 120.0], "opt_state_mb": [40.0, 40.0]}
            for i, v in enumerate(ips_per_round)]
    return {"name": name, "status": status, "reason": reason, "plan": {"workers": workers},
            "repeats": reps}


def test_summary_pairs_efficiency_by_round():
    base = _record("single-1t", [50.0, 40.0], workers=1)
    s = summarize(_record("ddp", [90.0, 80.0]), base, epoch_size=1000)
    assert s["efficiency_range"] == pytest.approx([0.9, 1.0])  # 90/100 and 80/80
    assert s["images_s"] == pytest.approx(85.0)
    assert s["s_per_epoch"] == pytest.approx(1000 / 85.0)
    assert s["peak_mb"] == 120.0


def test_table_has_every_row_and_reasons():
    base = _record("single-1t", [50.0], workers=1)
    rows = [summarize(base, base, 1000), summarize(_record("ddp", [90.0]), base, 1000),
            summarize(_record("dp", [], status="skipped", reason="needs >= 2 CUDA devices"),
                      base, 1000)]
    table = render_table(rows).splitlines()
    assert table[0].startswith("| row | images/s")
    assert len(table) == 2 + 3
    assert "`dp`" in table[4] and "skipped: needs >= 2 CUDA devices" in table[4]
    assert "| 0.90 |" in table[3]
    assert "top-1" in render_table(rows, accuracy=True)


def test_cpu_skip_reasons():
    cfg = BenchConfig()
    reasons = {n: skip_reason(ROWS[n], cfg, CPU_CAPS) for n in ROWS}
    assert "CUDA" in reasons["dp"] and "CUDA" in reasons["ddp-fp16"]
    assert "SyncBatchNorm" in reasons["ddp-syncbn"] and "horovod" in reasons["horovod"]
    assert reasons["ddp-hook-bf16"] is None  # ddpkit's bf16 hook runs on gloo too
    assert "bf16" in reasons["ddp-bf16"]  # default rows on a CPU that only emulates bf16
    assert reasons["ddp"] is None and reasons["zero"] is None
    asked = BenchConfig(rows=["ddp-bf16"], rows_given=True)
    assert skip_reason(ROWS["ddp-bf16"], asked, CPU_CAPS) is None


def test_gpu_rows_skip_without_cuda_and_run_with_one_gpu():
    gpu_rows = [n for n in ROWS if n.startswith("gpu-")]
    assert set(gpu_rows) <= set(DEFAULT_ROWS)
    assert {skip_reason(ROWS[n], BenchConfig(), CPU_CAPS) for n in gpu_rows} == {
        "needs a CUDA GPU (found none)"}
    one_gpu = dict(CPU_CAPS, cuda_count=1, native_bf16=True)
    assert all(skip_reason(ROWS[n], BenchConfig(), one_gpu) is None for n in gpu_rows)
    assert skip_reason(ROWS["dp"], BenchConfig(), one_gpu) == "needs >= 2 CUDA devices (found 1)"
    loader = plan_row(ROWS["gpu-cpu-loader"], BenchConfig(), one_gpu)["job"]
    compiled = plan_row(ROWS["gpu-compile"], BenchConfig(), one_gpu)["job"]
    assert (loader["device_data"], compiled["device_data"], compiled["compile"]) == (
        "off", "auto", True)


def test_ranks_sharing_one_gpu_are_labelled_functional():
    one_gpu = dict(CPU_CAPS, cuda_count=1, native_bf16=True)
    plan = plan_row(ROWS["ddp"], BenchConfig(nproc=2), one_gpu)
    assert plan["job"]["backend"] == "gloo"
    assert plan["functional"] == "functional, not speed: 2 processes share 1 GPU(s) over gloo"
    assert plan_row(ROWS["ddp"], BenchConfig(nproc=2), CPU_CAPS)["functional"] is None
    record = _record("ddp", [10.0])
    record["plan"]["functional"] = plan["functional"]
    table = render_table([summarize(record, None, 50_000)])
    assert "ok; functional, not speed: 2 processes share 1 GPU(s) over gloo" in table


def test_plan_threads_and_workers():
    cfg = BenchConfig(nproc=2, threads=1, batch=64)
    single = plan_row(ROWS["single-1t"], cfg, CPU_CAPS)
    ddp = plan_row(ROWS["ddp"], cfg, CPU_CAPS)
    assert (single["nprocs"], single["threads"], single["global_batch"]) == (1, 1, 64)
    assert (ddp["nprocs"], ddp["workers"], ddp["global_batch"]) == (2, 2, 128)
    assert plan_row(ROWS["single-all"], cfg, CPU_CAPS)["threads"] == (os.cpu_count() or 1)


def test_accumulation_batch_must_split():
    with pytest.raises(ConfigError, match="accum-steps"):
        BenchConfig(rows=["ddp-accum"], batch=10, accum_steps=4).check()


@pytest.mark.slow
def test_bench_a_language_model(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "bench", "--model", "gpt", "--rows",
                           "single-1t,ddp", "--steps", "2", "--repeats", "1", "--output",
                           str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())["summary"]
    assert [(r["row"], r["status"]) for r in rows] == [("single-1t", "ok"), ("ddp", "ok")]
    assert all(r["images_s"] > 0 for r in rows)


@pytest.mark.slow
def test_quick_bench_smoke(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "bench", "--quick", "--output",
                           str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    env = data["environment"]
    for key in ("cpu_model", "cpu_flags", "cores", "threads_per_process", "torch", "backend",
                "devices", "batch_per_rank", "loader_workers", "command"):
        assert key in env, key
    by_row = {s["row"]: s for s in data["summary"]}
    assert list(by_row) == env["rows_requested"]
    for rec in data["rows"]:
        if rec["status"] == "ok":
            s = by_row[rec["name"]]
            assert s["images_s"] > 0 and s["step_ms_p95"] >= s["step_ms_median"] > 0
            assert s["peak_mb"] > 0
            assert all(t > 0 for r in rec["repeats"] for ts in r["step_s"] for t in ts)
        else:
            assert rec["reason"], f"{rec['name']} is {rec['status']} without a reason"
    assert any(r["status"] == "ok" for r in data["rows"])
    table = (out / "results.md").read_text()
    for name in env["rows_requested"]:
        assert f"`{name}`" in table
    try:
        import matplotlib  # noqa: F401
        assert (out / "chart.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib" in table


@pytest.mark.slow
def test_peers_interleaved_smoke(tmp_path):
    """benchmarks/peers runs from a clone: hand-written DDP and ddpkit built in one job, steps
    alternating; both peers get figures and a paired ratio. Never a speed assertion."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "peers", "run_peers.py"),
         "--peers", "handwritten,ddpkit", "--interleave", "--rounds", "1", "--steps", "2",
         "--warmup", "1", "--model", "small_cnn", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["environment"]["interleave"] is True
    rows = {r["peer"]: r for r in saved["summary"]}
    assert set(rows) == {"handwritten", "ddpkit"}
    for name, row in rows.items():
        assert row["status"] == "ok", row
        assert row["images_s"] > 0 and row["rounds"] == 1
        (raw,) = saved["raw"][name]
        assert len(raw["step_s"]) == 2 and all(len(r) == 2 for r in raw["step_s"])  # 2 ranks
    assert rows["handwritten"]["ratio"] == 1.0 and rows["ddpkit"]["ratio"] > 0
    assert rows["ddpkit"]["step_pairs"] == 2 and rows["ddpkit"]["step_ratio"] > 0
    assert (tmp_path / "peers.md").read_text().count("| handwritten |") == 1


def test_the_dataparallel_row_without_gpus_plans_the_module_on_the_cpu():
    # a fresh clone's `ddpkit bench --quick` once stopped at planning this row: 0 GPUs made a
    # batch of 0 (the row is skipped on CPU; `--rows dp` measures it there anyway)
    plan = plan_row(ROWS["dp"], BenchConfig(batch=32), CPU_CAPS)
    assert plan["global_batch"] == 32 and plan["job"]["batch"] == 32 and plan["nprocs"] == 1
