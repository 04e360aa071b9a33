"""Count the Python processes of a test run that imported torch, and the CPU they spent doing so
(the suite's main cost on 2 cores: a figure that does not move with the host's day, where
minutes do). ``make test`` and ``make check`` wrap pytest in it:

    python scripts/torch_imports.py start .venv     # every process of that venv logs its import
    python -m pytest ...
    python scripts/torch_imports.py report .venv    # one line; the logging removed

``start`` puts a ``.pth`` file in the venv's site-packages (Python runs it at every start, whatever
PYTHONPATH or environment a test gives its processes); its module times the import of ``torch``
(and of ``torch._dynamo`` where torch's import did not load it) in process CPU time and appends
one line per import to the log. Forked processes (a fork server's ranks) inherit torch and are not
counted: they paid nothing. Processes killed before torch finished loading are not counted.
This script itself never imports torch.
"""
from __future__ import annotations

import glob
import os
import sys

PTH = "_ddpkit_torch_imports.pth"
MODULE = "_ddpkit_torch_imports.py"

HOOK = '''"""Written by ddpkit's scripts/torch_imports.py for a test run; removed by its report."""
import os, sys, time

LOG = {log!r}
WATCH = ("torch", "torch._dynamo")


class _Timed:
    busy = False

    def find_spec(self, name, path=None, target=None):
        if name not in WATCH or self.busy or name in sys.modules:
            return None
        import importlib.util
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        inner = spec.loader.exec_module
        nested = name != "torch" and "torch" in _Timed.loading

        def exec_module(module):
            _Timed.loading.add(name)
            start = time.process_time()
            try:
                inner(module)
            finally:
                _Timed.loading.discard(name)
            try:
                with open(LOG, "a") as f:
                    test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
                    # one line a process: `python -c CODE` has newlines in its argv
                    what = "|".join("_".join(a.split()) for a in sys.argv[:4])[:200]
                    f.write(f"{{os.getpid()}} {{name}} {{time.process_time() - start:.3f}} "
                            f"{{int(nested)}} {{test or '-'}} {{what or '-'}}\\n")
            except OSError:
                pass

        spec.loader.exec_module = exec_module
        return spec

    loading = set()


if os.path.exists(LOG):  # started: logging; the report removes this file
    sys.meta_path.insert(0, _Timed())
'''


def _site_packages(venv: str) -> str:
    found = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))
    if not found:
        sys.exit(f"error: no site-packages under {venv}; run make's set-up first")
    return found[0]


def start(venv: str) -> None:
    site = _site_packages(venv)
    log = os.path.abspath(os.path.join(venv, "torch-imports.log"))
    open(log, "w").close()
    with open(os.path.join(site, MODULE), "w") as f:
        f.write(HOOK.format(log=log))
    with open(os.path.join(site, PTH), "w") as f:
        f.write("import _ddpkit_torch_imports\n")


def report(venv: str) -> str:
    site = _site_packages(venv)
    log = os.path.join(venv, "torch-imports.log")
    for name in (PTH, MODULE):
        try:
            os.remove(os.path.join(site, name))
        except FileNotFoundError:
            pass
    processes, cpu, by_file = 0, 0.0, {}
    unread = 0
    try:
        with open(log) as f:
            for line in f:
                try:
                    _pid, name, seconds, nested, *test = line.split()[:5]
                    seconds_f = float(seconds)
                except ValueError:  # not a line of the hook's (a torn write): said, not counted
                    unread += 1
                    continue
                if name == "torch":  # once a process (pids are reused over a long run)
                    processes += 1
                    where = test[0].split("::")[0] if test else "-"
                    by_file[where] = by_file.get(where, 0) + 1
                if nested == "0":
                    cpu += seconds_f
    except FileNotFoundError:
        pass
    line = (f"torch imports: {processes} Python process{'es' if processes != 1 else ''} "
            f"imported torch, spending "
            f"{cpu:.0f} s of CPU importing it (torch, torch._dynamo)")
    if unread:
        line += f"; {unread} line(s) of the log not read"
    most = sorted(by_file.items(), key=lambda kv: -kv[1])[:5]
    if most and processes > 1:
        line += "; most: " + ", ".join(f"{os.path.basename(k)} {n}" for k, n in most)
    return line


def main(argv: list) -> None:
    if len(argv) != 2 or argv[0] not in ("start", "report"):
        sys.exit("usage: torch_imports.py start|report VENV")
    if argv[0] == "start":
        start(argv[1])
    else:
        print(report(argv[1]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
