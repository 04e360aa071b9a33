"""A script forked from a fork server runs as under ``python -u script.py`` (ddpkit.launchers.forked):
what it sees, how it ends; and ``ddpkit run``'s two start methods give the workers the same."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import forkrun
from ddpkit.launchers.forked import Forked

SEES = textwrap.dedent('''
    import atexit, json, os, sys, threading, time
    print("first", flush=False)          # unbuffered, as -u: in order with stderr
    print("second", file=sys.stderr)
    seen = {"argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
            "only_here": os.environ.get("ONLY_HERE"), "stdin": sys.stdin.read(),
            "parent_only": os.environ.get("PARENT_ONLY"),
            "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode().split("\\0"),
            "environ": sorted(set(open("/proc/self/environ", "rb").read().decode().split("\\0"))
                              - {""})}
    json.dump(seen, open(os.path.join(os.environ["OUT"], "seen.json"), "w"))
    atexit.register(lambda: print("atexit ran"))
    def late():
        time.sleep(0.2)
        print("thread joined")
    threading.Thread(target=late).start()
    how = sys.argv[1]
    if how == "exit3":
        sys.exit(3)
    if how == "raise":
        def inner():
            raise ValueError("the script's own error")
        inner()
    if how == "kill9":
        os.kill(os.getpid(), 9)
    if how == "message":
        sys.exit("stopped: said so")
''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "code" / "sees.py"
    path.parent.mkdir()
    path.write_text(SEES)
    return path


def _forked(script, how, cwd, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "PARENT_ONLY"}
    env.update({"ONLY_HERE": "yes", "OUT": str(cwd)}, **(env_extra or {}))
    proc = Forked([str(script), how, "--flag"], env=env, cwd=str(cwd))
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err, env


@pytest.mark.parametrize("how, code", [("ok", 0), ("exit3", 3), ("raise", 1), ("kill9", -9),
                                       ("message", 1)])
def test_a_forked_script_sees_and_ends_as_under_python(script, tmp_path, monkeypatch, how, code):
    monkeypatch.setenv("PARENT_ONLY", "not given")
    rc, out, err, env = _forked(script, how, tmp_path)
    assert rc == code, err
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"argv": [str(script), how, "--flag"], "name": "__main__",
                    "path0": str(script.parent), "cwd": str(tmp_path), "only_here": "yes",
                    "stdin": "", "parent_only": None,   # and ps shows the script, not the server
                    "cmdline": [sys.executable, str(script), how, "--flag"],
                    "environ": sorted(f"{k}={v}" for k, v in env.items())}
    assert out.startswith("first\n")
    assert err.startswith("second\n")
    if how != "kill9":   # the interpreter's end: non-daemon threads joined, then atexit
        assert out.endswith("thread joined\natexit ran\n"), out
    if how == "raise":   # the traceback starts at the script, as python prints it
        lines = err.splitlines()
        assert lines[1] == "Traceback (most recent call last):", err
        assert str(script) in lines[2] and "runpy" not in err and "forked.py" not in err
        assert lines[-1] == "ValueError: the script's own error"
    if how == "message":
        assert err.splitlines()[-1] == "stopped: said so"


def test_a_module_runs_from_the_working_directory_and_a_timeout_leaves_it_to_kill(tmp_path):
    (tmp_path / "mymod.py").write_text("import sys, time\nprint(sys.argv, sys.path[0])\n"
                                       "time.sleep(float(sys.argv[1]))\n")
    run = forkrun.python("-m", "mymod", "0", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{[str(tmp_path / 'mymod.py'), '0']} {tmp_path}\n"
    with pytest.raises(subprocess.TimeoutExpired):
        forkrun.python("-m", "mymod", "60", cwd=tmp_path, timeout=3)


WORKER = textwrap.dedent('''
    import json, os, sys
    import ddpkit
    rt = ddpkit.setup()
    json.dump({"argv": sys.argv, "name": __name__, "rank": rt.rank,
               "forked": os.environ.get("DDPKIT_FORKED_BY") is not None,
               "torch_loaded_before": "torch" in sys.modules},
              open(os.path.join(sys.argv[1], f"rank{rt.rank}.json"), "w"))
    rt.print0("done")
    rt.shutdown()
    if rt.rank == 1 and len(sys.argv) > 2:
        raise SystemExit(int(sys.argv[2]))
''')


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ddpkit_run_starts_the_same_workers_either_way(tmp_path, method):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    res = forkrun.ddpkit("run", "--nproc", "2", "--start-method", method, str(script),
                         str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("done") == 1
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["argv"] == [str(script), str(tmp_path)] and seen["name"] == "__main__"
        assert seen["forked"] == (method == "forkserver")
    # a rank's own exit status fails the run, in one line, either way
    res = forkrun.ddpkit("run", "--nproc", "2", "--start-method", method, str(script),
                         str(tmp_path), "7", cwd=tmp_path)
    assert res.returncode != 0
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit run: rank "), res.stderr[-3000:]


def test_the_start_method_is_a_flag_of_run_and_train_and_reaches_the_launcher():
    from ddpkit.cli import build_parser
    from ddpkit.cli.flags import run_config

    for command in ("run", "train"):
        ns = build_parser().parse_args([command] + (["x.py"] if command == "run" else []))
        assert ns.start_method == "forkserver"
        ns = build_parser().parse_args([command, "--start-method", "spawn"]
                                       + (["x.py"] if command == "run" else []))
        assert run_config(ns, "x.py").start_method == "spawn"
    res = forkrun.ddpkit("run", "--start-method", "fork", "x.py")
    assert res.returncode == 2 and "invalid choice: 'fork'" in res.stderr


def test_the_scripts_own_processes_start_as_under_python(tmp_path):
    """A forked worker inherits multiprocessing's forkserver from its server: DataLoader
    workers then started from a server of their own and outlived a killed rank."""
    import multiprocessing

    (tmp_path / "m.py").write_text(
        "import multiprocessing as mp, os\n"
        "def child(q): q.put(os.getppid())\n"
        "q = mp.Queue(); p = mp.Process(target=child, args=(q,)); p.start()\n"
        "print(mp.get_start_method(), q.get() == os.getpid()); p.join()\n")
    run = forkrun.python(str(tmp_path / "m.py"), cwd=tmp_path)
    assert run.stdout == f"{multiprocessing.get_start_method()} True\n", run.stderr


def test_ranks_that_end_by_os_exit_0_end_the_run(tmp_path):
    """A forked worker that leaves by os._exit(0) returns no value to torch's process context,
    which then waited for it forever (ddpkit verify's runs end so); fresh interpreters' exit
    code 0 is a success, and so is it here."""
    script = tmp_path / "leave.py"
    script.write_text("import os, torch, ddpkit\nrt = ddpkit.setup()\nrt.reduce(torch.ones(1))\n"
                      "os.write(1, f'left {rt.rank}\\n'.encode())\nos._exit(0)\n")  # one write
    res = forkrun.ddpkit("run", "--nproc", "2", str(script), cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and sorted(res.stdout.split("\n")[:2]) == ["left 0", "left 1"], \
        res.stdout + res.stderr


LATE = textwrap.dedent('''
    import os, sys
    from ddpkit.launchers import forked
    from ddpkit.launchers.torchrun import RunConfig, run
    if __name__ == "__main__":
        forked.start_server()   # a server started earlier in this process (in-process use)
        os.environ["LATE_VAR"] = "set after the server started"
        sys.exit(run(RunConfig(sys.argv[1], [], nproc=2)))
''')


def test_workers_get_the_launchers_environment_as_it_is_when_they_start(tmp_path):
    (tmp_path / "launch.py").write_text(LATE)
    (tmp_path / "worker.py").write_text("import os\nos.write(1, f\"{os.environ['RANK']} "
                                        "{os.environ.get('LATE_VAR')}\\n\".encode())\n")
    res = forkrun.python(str(tmp_path / "launch.py"), str(tmp_path / "worker.py"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["0 set after the server started",
                                               "1 set after the server started"]
