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
    line = torch_imports.report(str(tmp_path))
    assert line.startswith("torch imports: 1 Python process imported torch, spending "), line
    assert os.listdir(site) == []   # the hook is gone: later runs of the venv log nothing
