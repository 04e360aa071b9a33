"""``ddpkit doctor`` on two real nodes (network namespaces, tests/netns.py) behind a link shaped
to 100 Mbit/s with tc tbf: the sweep's fitted bandwidth is the link's, both routes and hosts are
named, the rendezvous port is known as the job's own. Needs root; skips otherwise."""
import json
import os
import re
import sys

import pytest

from netns import Cluster, available

OK, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=WHY)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 29400


def test_doctor_measures_a_shaped_link_between_two_nodes(tmp_path):
    reports = [tmp_path / f"doctor{i}.json" for i in range(2)]
    with Cluster(2, workdir=tmp_path / "nodes") as c:
        for i in range(2):
            c.shape(i, "100mbit")
        for i in range(2):
            c.start(i, [sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "--nproc", "1",
                        "--node-rank", str(i), "--rdzv-endpoint", f"{c.ip(0)}:{PORT}",
                        "-m", "ddpkit.doctor", "--max-bytes", "4M",
                        "--output", str(tmp_path / "ckpt"), "--json", str(reports[i]),
                        "--params", "1000000"],
                    cwd=ROOT)
        codes = c.wait(timeout=180)
        out = c.output(0)
    assert codes == [0, 0], c.tails()
    for name in ("versions", "backend", "network", "ports", "checkpoints", "clocks", "link",
                 "timeout"):
        assert f"ok    {name}:" in out, out
    assert "gloo all-reduce over 2 rank(s)" in out and "every node sees it" in out
    # how much of an all-reduce hides behind compute: measured, so ok or warn, never a failure
    assert re.search(r"^(ok|warn)\s+overlap: an all-reduce of [\d.]+ MiB beside compute", out,
                     re.M), out
    assert f"{c.hostname(1)} via eth0 ({c.ip(1)})" in out
    data = json.loads(reports[0].read_text())
    assert -1.0 <= data["link"]["overlap"] <= 1.0
    payload = 100e6 / 8 * 0.94                  # tbf at 100 Mbit/s, TCP's share of it
    assert data["link"]["beta"] == pytest.approx(payload, rel=0.25), data["sweep"]
    # the timeout line follows from the link this sweep measured (never faster than its peak):
    # 4 MB of gradients over 2 ranks is one ring all-reduce, 2 latencies + 4 MB / beta
    said = re.search(r"one all-reduce of 1\.0 M parameters' fp32 gradients takes ([\d.]+) s over "
                     r"this link on 2 ranks, within the collective timeout", out)
    assert said, out
    beta = min(data["link"]["beta"], max(r["busbw"] for r in data["sweep"]))
    assert float(said.group(1)) == pytest.approx(2 * data["link"]["alpha"] + 4e6 / beta, abs=0.06)
    assert 0.25 <= float(said.group(1)) <= 0.5     # 4 MB over 100 Mbit/s, give or take tbf
    assert {f["host"] for f in data["facts"]} == {c.hostname(0), c.hostname(1)}
