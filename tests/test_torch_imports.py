"""scripts/torch_imports.py: the count `make test` ends with (processes that imported torch,
and the CPU they spent on it), from the hook its .pth puts in a venv's site-packages."""
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import torch_imports  # noqa: E402


def test_a_process_that_imports_torch_is_counted_and_the_report_removes_the_hook(tmp_path):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    torch_imports.start(str(tmp_path))
    # one process importing torch (counted), one that does not (not counted)
    # -S: not this venv's own site-packages, whose hook is active while make test counts
    torch_dir = str(Path(torch.__file__).resolve().parent.parent)
    for code in ("import torch", "import json"):
        subprocess.run([sys.executable, "-S", "-c", f"import site, sys; "
                        f"site.addsitedir({str(site)!r}); sys.path.append({torch_dir!r}); "
                        f"{code}"], check=True, timeout=120)
    lines = (tmp_path / "torch-imports.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].split()[1] == "torch", lines
    assert float(lines[0].split()[2]) > 0
    # the test that started the process (pytest's PYTEST_CURRENT_TEST, inherited)
    assert lines[0].split()[4].startswith("tests/test_torch_imports.py::test_a_process"), lines
    line = torch_imports.report(str(tmp_path))
    assert line.startswith("torch imports: 1 Python process imported torch, spending "), line
    assert os.listdir(site) == []   # the hook is gone: later runs of the venv log nothing


def test_the_report_names_the_test_files_that_started_the_most(tmp_path):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (tmp_path / "torch-imports.log").write_text(
        "1 torch 2.0 0 tests/test_a.py::one\n2 torch 2.0 0 tests/test_a.py::two\n"
        "2 torch._dynamo 1.0 0 tests/test_a.py::two\n3 torch 2.0 0 tests/test_b.py::x\n"
        "4 torch 2.0 0\n")                       # a line of the older form: no test named
    line = torch_imports.report(str(tmp_path))
    assert line == ("torch imports: 4 Python processes imported torch, spending 9 s of CPU "
                    "importing it (torch, torch._dynamo); most: test_a.py 2, test_b.py 1, - 1")


def test_a_line_that_is_not_the_hooks_is_said_and_the_lines_after_it_still_count(tmp_path):
    # a process run as `python -c CODE` once wrote its CODE's newlines into the log, and the
    # count stopped at the first broken line (533 of 906 processes)
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (tmp_path / "torch-imports.log").write_text(
        "1 torch 2.0 0 tests/test_a.py::one -c|import_torch\nprint(1)\n"
        "2 torch 2.0 0 tests/test_a.py::two x\n1 torch 2.0 0 tests/test_b.py::x y\n")
    line = torch_imports.report(str(tmp_path))
    assert line.startswith("torch imports: 3 Python processes imported torch, spending 6 s of "
                           "CPU importing it (torch, torch._dynamo); 1 line(s) of the log not "
                           "read; most: test_a.py 2"), line
