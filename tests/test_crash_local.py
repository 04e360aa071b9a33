"""Tests for ddpkit.crash on one node: ranks that fail the same way print one traceback."""
import os
import subprocess
import sys
import time

import pytest

from ddpkit.crash import failure_digest

CLEAN = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
TRACEBACK = "Traceback (most recent call last)"


def _run(tmp_path, source):
    script = tmp_path / "fails.py"
    script.write_text(source)
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script)],
                         capture_output=True, text=True, timeout=120, env=CLEAN)
    assert time.monotonic() - start < 60
    return res


def test_the_digest_leaves_out_what_differs_between_ranks():
    def text(rank, pid, address, device):
        return (f'File "train.py", line 9, in step\nRuntimeError: rank {rank} (pid {pid}) at '
                f"{address} on cuda:{device}: tensor at 0x7f{pid}a0 is bad")

    assert failure_digest(text(0, 4242, "10.0.0.1:29500", 0)) == \
        failure_digest(text(1, 4343, "10.0.0.2:29501", 1))
    assert failure_digest(text(0, 1, "x", 0)) != \
        failure_digest(text(0, 1, "x", 0).replace("line 9", "line 10"))
    assert failure_digest("ValueError: bad value 42") != failure_digest("ValueError: bad value 43")


SAME = """import ddpkit
rt = ddpkit.setup()
def broken(value):
    raise ValueError(f"bad value {value} on rank {rt.rank}")
broken(42)
"""


@pytest.mark.slow
def test_ranks_that_fail_the_same_way_print_one_traceback(tmp_path):
    res = _run(tmp_path, SAME)
    assert res.returncode == 1
    assert res.stderr.count(TRACEBACK) == 1, res.stderr
    errors = [line for line in res.stderr.splitlines()
              if line.startswith(("ValueError: bad value 42", "[rank 1] ValueError: bad value 42"))]
    assert len(errors) == 1, res.stderr
    same = [line for line in res.stderr.splitlines() if "failed the same way" in line]
    # The other rank's line, unless the launcher stopped it first (it may: the error is out).
    assert len(same) <= 1, res.stderr
    for line in same:
        assert line in ("rank 0 failed the same way (ValueError: bad value 42 on rank 0)",
                        "rank 1 failed the same way (ValueError: bad value 42 on rank 1)")
    assert "ddpkit run: rank " in res.stderr


DIFFERENT = """import ddpkit
rt = ddpkit.setup()
if rt.rank == 0:
    raise ValueError("rank zero's own problem")
raise KeyError("rank one's own problem")
"""


@pytest.mark.slow
def test_ranks_that_fail_differently_print_both_tracebacks(tmp_path):
    res = _run(tmp_path, DIFFERENT)
    assert res.returncode == 1
    assert res.stderr.count(TRACEBACK) == 2, res.stderr
    assert "ValueError: rank zero's own problem" in res.stderr
    assert "[rank 1] KeyError: \"rank one's own problem\"" in res.stderr
    assert "failed the same way" not in res.stderr
