"""``ddpkit doctor``: every finding on 2 real processes with an all-reduce sweep whose JSON
``ddpkit plan`` reads; one process; bad input one line; the findings that need a broken cluster
(versions that differ, clocks apart, no route) on facts made by hand."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ddpkit.cli import main
from ddpkit.doctor.checks import routes, versions
from ddpkit.doctor import cluster
from ddpkit.doctor.cluster import MOST_REPEATS, clocks, overlap_finding, sweep_sizes
from ddpkit.doctor.run import parse_size

import forkrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ddpkit(*args, timeout=180):
    return forkrun.ddpkit(*args, timeout=timeout, clean=False)


@pytest.mark.slow
def test_doctor_on_two_processes_checks_everything_and_plan_reads_its_link(tmp_path):
    report = tmp_path / "doctor.json"
    proc = _ddpkit("doctor", "--nproc", "2", "--max-bytes", "256K", "--output",
                   str(tmp_path / "ckpt"), "--json", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    names = [line.split(":")[0].split()[-1] for line in lines if line.startswith(("ok", "warn"))]
    assert names == ["versions", "backend", "network", "ports", "checkpoints", "clocks", "link",
                     "overlap", "timeout"]
    assert "gloo all-reduce over 2 rank(s)" in proc.stdout
    data = json.loads(report.read_text())
    assert [r["bytes"] for r in data["sweep"]] == [1024, 4096, 16384, 65536, 262144]
    for row in data["sweep"]:
        assert row["busbw"] == pytest.approx(row["algbw"])   # 2(N-1)/N = 1 for N = 2
        assert row["algbw"] == pytest.approx(row["bytes"] / row["seconds"])
    assert data["link"]["alpha"] >= 0 and data["link"]["beta"] > 0
    assert -1.0 <= data["link"]["overlap"] <= 1.0
    for row in data["sweep"]:     # the mean of its repeats (what a step pays), its median too
        assert 3 <= row["repeats"] <= MOST_REPEATS and row["median"] > 0 and row["seconds"] > 0
    said = next(f for f in data["findings"] if f["name"] == "overlap")["detail"]
    assert said.startswith("an all-reduce of 0.25 MiB beside compute: compute ") and \
        f"overlap {data['link']['overlap']:.2f} (" in said
    assert len(data["facts"]) == 2 and all(f["verdict"] != "FAIL" for f in data["findings"])
    assert main(["plan", "--params", "1e6", "--compute-ms", "10", "--nodes", "2",
                 "--link", str(report)]) == 0


def test_doctor_on_one_process_and_an_unwritable_checkpoint_directory(capsys):
    assert main(["doctor", "--nproc", "1", "--output", "/proc/ddpkit-doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  checkpoints: /proc/ddpkit-doctor is not writable here" in out
    assert "one process: nothing to measure" in out


@pytest.mark.parametrize("args,said", [
    (["--max-bytes", "12"], "--max-bytes '12'"),
    (["--max-bytes", "lots"], "--max-bytes 'LOTS'"),
    (["--nproc", "0"], "--nproc must be >= 1"),
])
def test_bad_doctor_input_is_one_line(args, said, capsys):
    assert main(["doctor", *args]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and said in err[0], err


def test_sizes_and_units():
    assert sweep_sizes(1 << 20) == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert parse_size("256M") == 256 << 20 and parse_size("64KiB") == 64 << 10
    assert parse_size("1g") == 1 << 30 and parse_size("4096") == 4096


def test_findings_of_a_broken_cluster_name_the_fix():
    facts = [{"host": "a", "torch": "2.13.0", "python": "3.11", "cuda": None, "nccl": None,
              "iface": "eth0", "source": "10.0.0.1"},
             {"host": "b", "torch": "2.11.0", "python": "3.11", "cuda": None, "nccl": None,
              "iface": None, "source": None}]
    found = versions(facts)
    assert found.verdict == "FAIL" and "2.13.0 on a; 2.11.0 on b" in found.detail
    assert "install one torch version" in found.line()
    assert routes(facts, "10.0.0.1").verdict == "warn"
    assert "b" in routes(facts, "10.0.0.1").detail
    apart = clocks([(100.0, 100.01), (105.0, 105.01)])
    assert apart.verdict == "FAIL" and "+5.00 s" in apart.detail and "NTP" in apart.fix
    assert clocks([(100.0, 100.02), (100.01, 100.03)]).verdict == "ok"


def test_a_checkpoint_directory_the_nodes_do_not_share_fails_with_the_fix(tmp_path, monkeypatch):
    from ddpkit.doctor import cluster
    from ddpkit.base.errors import JobSetupError

    def blind(directory, num_nodes, wait_s):
        raise JobSetupError(f"checkpoint directory {directory} is not shared between the nodes: "
                            "node1 cannot see what rank 0 writes there")
    monkeypatch.setattr(cluster, "check_shared", blind)
    found = cluster.shared(str(tmp_path), 2)
    assert found.verdict == "FAIL" and "is not shared between the nodes" in found.detail
    assert "storage every node mounts" in found.fix


def test_a_link_too_slow_for_the_collective_timeout_is_named_with_its_fix():
    from ddpkit.doctor.cluster import timeout_finding
    from ddpkit.cost.model import LINKS

    slow = timeout_finding(LINKS["10mbit"], 2, 600, params=1_000_000_000)   # 4 GB at 1.2 MB/s
    assert slow.verdict == "FAIL" and "past the collective timeout of 600 s" in slow.detail
    assert "--timeout-s" in slow.fix and "--comm-hook auto" in slow.fix
    assert timeout_finding(LINKS["10mbit"], 2, 600, params=50_000_000).verdict == "warn"
    assert timeout_finding(LINKS["10gbit"], 2, 600, params=50_000_000).verdict == "ok"
    largest = timeout_finding(LINKS["1gbit"], 2, 600)
    assert largest.verdict == "ok" and "17.6 GB" in largest.detail   # 150 s at 117.5 MB/s


@pytest.mark.slow
def test_doctor_fails_on_two_processes_when_the_model_would_time_out(tmp_path):
    proc = _ddpkit("doctor", "--nproc", "2", "--max-bytes", "64K", "--params", "3000000000",
                   "--timeout-s", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fail = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1 and fail[0].startswith("FAIL  timeout: one all-reduce of 3,000.0 M"), \
        proc.stdout


@pytest.mark.parametrize("args, said", [
    (["--params", "0"], "--params must be >= 1, got 0"),
    (["--timeout-s", "0"], "--timeout-s must be > 0, got 0"),
])
def test_doctor_numbers_out_of_range_are_one_line(args, said):
    proc = _ddpkit("doctor", *args)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [f"error: {said}"], proc.stderr


def test_a_sweep_too_short_to_fit_a_bandwidth_says_so_and_the_timeout_uses_what_was_seen():
    from ddpkit.doctor.cluster import link_finding, timeout_finding

    rows = [{"bytes": b, "seconds": 3e-4, "busbw": b / 3e-4} for b in (1024, 4096, 65536)]
    finding, link = link_finding(rows, 2)       # flat: the slope is 0
    assert finding.verdict == "warn" and "--max-bytes" in finding.fix
    assert link.beta == rows[-1]["busbw"]
    slow = timeout_finding(link, 2, 1.0, params=3_000_000_000, peak_busbw=rows[-1]["busbw"])
    assert slow.verdict == "FAIL"


def test_the_overlap_line_warns_when_the_all_reduce_takes_the_compute_cores():
    measured = {"overlap": 0.16, "bytes": 16 << 20, "compute_s": 0.0149, "allreduce_s": 0.0167,
                "together_s": 0.0292}
    low = overlap_finding(measured)
    assert low.verdict == "warn" and low.detail == (
        "an all-reduce of 16 MiB beside compute: compute 14.9 ms, all-reduce 16.7 ms, both at "
        "once 29.2 ms: overlap 0.16 (16% of the shorter hides behind the other): the gradients' "
        "all-reduce takes the cores the backward needs, so DDP's overlap hides little")
    assert "--comm-hook auto" in low.fix
    assert overlap_finding({**measured, "overlap": 0.8}).verdict == "ok"
    worse = overlap_finding({**measured, "overlap": -0.3, "together_s": 0.0366})
    assert worse.verdict == "warn" and \
        "overlap -0.30 (both at once take longer than one after the other)" in worse.detail


def test_the_sweep_reports_the_mean_a_step_pays_with_the_median_beside_it(monkeypatch):
    """A small all-reduce on a busy 2-core VM took either ~0.4 ms or ~4 ms: the median of its
    repeats lands on either mode, the mean is what a step pays. Each size is timed at least 3
    times, then until its share of the budget is spent, at most MOST_REPEATS times, the sizes
    taking turns."""
    import types

    monkeypatch.setattr(cluster, "tdist", types.SimpleNamespace(
        get_world_size=lambda: 2, all_reduce=lambda *args, **kwargs: None))
    pattern = [4e-4, 4e-4, 4e-3]                       # the fast mode twice, the slow once
    calls = []

    def timed(buffer):
        calls.append(buffer.numel())
        return pattern[(len(calls) - 1) % 3]

    monkeypatch.setattr(cluster, "time_allreduce", timed)
    short, = cluster.sweep(torch.device("cpu"), [1024], budget_s=1.0)
    assert short["repeats"] == MOST_REPEATS                  # 240 x 1.6 ms < 1 s: the cap
    assert short["seconds"] == pytest.approx(1.6e-3) and short["median"] == pytest.approx(4e-4)
    assert short["algbw"] == pytest.approx(1024 / 1.6e-3)
    calls.clear()
    long, = cluster.sweep(torch.device("cpu"), [1024], budget_s=1e-4)
    assert long["repeats"] == 3 and long["seconds"] == pytest.approx(1.6e-3)   # at least 3
    calls.clear()
    rows = cluster.sweep(torch.device("cpu"), [1024], budget_s=0.03)
    # the share is 30 ms: 20 repeats spend 29.6 ms, the 21st (a slow one) passes it
    assert [r["repeats"] for r in rows] == [21] and calls == [256] * 21
    calls.clear()
    # a slow phase of the host (the first 10 all-reduces) falls on both sizes alike: they take
    # turns, where one after the other the first size took all of it
    monkeypatch.setattr(cluster, "time_allreduce",
                        lambda buffer: calls.append(buffer.numel()) or
                        (4e-3 if len(calls) <= 10 else 4e-4))
    rows = cluster.sweep(torch.device("cpu"), [1024, 4096], budget_s=1.0)
    assert calls == [256, 1024] * MOST_REPEATS
    assert rows[0]["seconds"] == rows[1]["seconds"] == pytest.approx(
        (5 * 4e-3 + (MOST_REPEATS - 5) * 4e-4) / MOST_REPEATS)
    calls.clear()
    # a size leaves the rounds when it is done, the others go on: 115 ms a size, the small one
    # reaches the cap (240 x 0.4 ms), the large one its share (29 x 4 ms)
    monkeypatch.setattr(cluster, "time_allreduce",
                        lambda buffer: calls.append(buffer.numel()) or
                        (4e-4 if buffer.numel() == 256 else 4e-3))
    rows = cluster.sweep(torch.device("cpu"), [1024, 4096], budget_s=0.23)
    assert MOST_REPEATS * 4e-4 < 0.115 and [r["repeats"] for r in rows] == [MOST_REPEATS, 29]
    assert calls == [256, 1024] * 29 + [256] * (MOST_REPEATS - 29)
    assert cluster.sweep(torch.device("cpu"), [], budget_s=1.0) == []


def test_a_link_whose_small_messages_take_hundreds_of_us_never_fits_alpha_0():
    """Issue 34: doctor said alpha 0 us on a 100 Mbit/s link where a 1 KiB all-reduce took
    337 us. The largest messages, slowed to a third of the line rate (a shaper's queue, TCP
    backing off), gave a beta that took more than the small messages' whole time for their
    bytes; the small sizes' bytes now come off at the fastest rate seen."""
    from ddpkit.doctor.cluster import link_finding
    from ddpkit.cost.model import bandwidths

    line = 100e6 / 8 * 0.94                                   # 100 Mbit/s of TCP payload
    rows = []
    for size in [1 << k for k in range(10, 25, 2)]:           # 1 KiB .. 16 MiB
        seconds = 250e-6 + size / (line if size <= 1 << 18 else line / 3)
        algbw, busbw = bandwidths(size, 2, seconds)
        rows.append({"bytes": size, "seconds": seconds, "algbw": algbw, "busbw": busbw})
    assert rows[0]["seconds"] == pytest.approx(337e-6, abs=1e-6)
    finding, link = link_finding(rows, 2)
    assert link.beta == pytest.approx(line / 3, rel=1e-6)     # what the large messages got
    latency = 2 * link.alpha                                  # 2(N-1) hops on 2 ranks
    assert 200e-6 < latency < 337e-6                          # 250 us: the messages' latency
    assert f"alpha {link.alpha * 1e6:.1f} us" in finding.detail and link.alpha > 0
    # all of a message's time stays latency when even the fastest rate leaves nothing over
    from ddpkit.cost.model import fit_link
    assert fit_link([1024, 4096, 1 << 20], [3e-4, 1.2e-3, 1.0], 2).alpha > 0
