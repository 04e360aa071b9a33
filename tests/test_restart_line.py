"""kill -9 of a rank under `ddpkit train --max-restarts 1` (issue 22, row 12): the launcher names
the rank and how it died in one line, the restarted job says which checkpoint it resumed from,
and the start-up banner is not printed a second time."""
import glob
import os
import re
import signal
import time

import pytest

from test_chaos import Job, _left_behind, _workers

BANNER = "All distributed processes registered. Starting with 2 processes"


def _wait_for_checkpoint(job, timeout=120):
    """A whole checkpoint on disk (they are written to a temp file and renamed)."""
    deadline = time.monotonic() + timeout
    while not glob.glob(os.path.join(job.out, "checkpoints", "ckpt-*.pt")):
        assert job.proc.poll() is None, "the job ended early:\n" + job.proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint written in time"
        time.sleep(0.1)


@pytest.mark.slow
def test_kill_9_names_the_rank_and_the_restart_resumes_without_a_second_banner(tmp_path):
    job = Job(tmp_path / "run", "--epochs", "3", "--max-restarts", "1")
    _wait_for_checkpoint(job)
    os.kill(_workers(job.out)[1], signal.SIGKILL)
    out, err = job.proc.communicate(timeout=240)
    assert job.proc.returncode == 0, err[-3000:]
    assert err.splitlines() == [
        "ddpkit run: rank 1 failed (killed by SIGKILL; it printed no error: killed from outside, "
        "out of memory, or a crash in native code); restarting every rank (restart 1 of 1)"]
    assert out.count(BANNER) == 1 and out.count("Initializing distributed: GLOBAL_RANK: 0") == 1
    assert out.count("Total params") == 1 and out.count("\ntrain: ") == 1, out[-3000:]
    resumed = re.findall(r"^resumed from (\S+) at step \d+ \((?:end of )?epoch \d+\)$", out, re.M)
    assert len(resumed) == 1 and os.path.isfile(resumed[0]), out[-2000:]
    assert "final: top-1" in out and not _left_behind(job.out)


def _failure(code, recorded=False, timestamp=5):
    from types import SimpleNamespace

    return SimpleNamespace(exitcode=code, timestamp=timestamp,
                           error_file_data={"message": {"message": "E"}} if recorded else {})


@pytest.mark.parametrize("failures, first", [
    ({0: _failure(1), 1: _failure(-9)}, 1),        # the killed rank, not the one that lost it
    ({0: _failure(1), 1: _failure(-15)}, 0),       # SIGTERM: the agent stopping the rest
    ({1: _failure(-15), 0: _failure(1)}, 1),       # then the order the agent saw them in
    ({0: _failure(-9), 1: _failure(1, True)}, 1),  # a recorded error is the cause
    ({1: _failure(1, True, 7), 0: _failure(1, True, 6)}, 0),  # the earliest recorded one
])
def test_the_failure_named_is_the_cause_not_a_consequence(failures, first):
    from ddpkit.launchers.restarts import first_failure as _first_failure

    assert _first_failure(failures)[0] == first


@pytest.mark.parametrize("failure, one_line", [
    (_failure(2, recorded=True), True),    # a ddpkit error: its `error:` line says it all
    (_failure(2), False),                  # exit 2 without a recorded error (argparse, sys.exit)
    (_failure(1, recorded=True), False),   # a traceback: the launcher names the rank
    (_failure(-9), False),
])
def test_a_ranks_one_line_error_gets_no_second_line_from_the_launcher(failure, one_line):
    from ddpkit.launchers.restarts import said_in_one_line

    assert said_in_one_line(failure) == one_line


def test_sigabrt_points_at_what_the_rank_printed():
    import signal

    from ddpkit.launchers.restarts import how

    said = how(_failure(-signal.SIGABRT))
    assert "its own message, if it printed one, is above" in said
    assert "collective mismatch" in said and "killed from outside" not in said


@pytest.mark.slow
def test_restarts_used_up_end_with_the_command_that_resumes(tmp_path):
    """Issue, third round, row 13: the last line of ddpkit train gave no resume command."""
    job = Job(tmp_path / "run", "--max-restarts", "1")
    _wait_for_checkpoint(job)
    first = _workers(job.out)[1]
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while _workers(job.out).get(1, first) == first:  # the restarted group's rank 1
        assert job.proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(_workers(job.out)[1], signal.SIGKILL)
    out, err = job.proc.communicate(timeout=120)
    assert job.proc.returncode == 1, err[-3000:]
    last = err.splitlines()[-1]
    assert re.fullmatch(
        r"ddpkit run: rank 1 failed \(killed by SIGKILL; .*\) after 1 restart \(--max-restarts 1, "
        r"all used\); last checkpoint \S+/ckpt-\d+\.pt: continue with `ddpkit train --config "
        + re.escape(os.path.join(job.out, "config.json")) + r" --resume auto`", last), last
    assert not _left_behind(job.out)
