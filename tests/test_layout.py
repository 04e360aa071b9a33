"""The house: the layering contract covers every core module, every public name documents
itself with an example, modules stay small, and the generated blocks of README.md and docs/ are
current."""
import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "ddpkit"
PRODUCTS = {"launchers", "job", "plan", "doctor", "verify", "bench", "cli"}


def _contracts():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_core_contract_names_every_core_module_and_the_layers_every_product():
    core = {f"ddpkit.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem not in ("__init__",
                                                                                 "__main__")}
    core |= {f"ddpkit.{p.name}" for p in PACKAGE.iterdir()
             if p.is_dir() and (p / "__init__.py").exists() and p.name not in PRODUCTS}
    forbidden = next(c for c in _contracts() if c["type"] == "forbidden")
    assert set(forbidden["source_modules"]) == core
    assert set(forbidden["forbidden_modules"]) == {f"ddpkit.{p}" for p in PRODUCTS}
    layers = next(c for c in _contracts() if c["type"] == "layers")
    assert layers["layers"] == ["ddpkit.cli", "ddpkit.bench", "ddpkit.verify", "ddpkit.doctor",
                                "ddpkit.plan", "ddpkit.job", "ddpkit.launchers"]


def test_import_ddpkit_loads_no_product():
    """The root package is exempt from the core contract (products are its submodules), so its
    own imports are read here: a product (the launchers, torchrun's agent with them) loads only
    when asked for, through the module's __getattr__ (``ddpkit.launch``)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    eager = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level
             and not any(isinstance(f, ast.FunctionDef) and node in ast.walk(f)
                         for f in tree.body)]
    loaded = {(node.module or "").split(".")[0] for node in eager}
    assert not loaded & PRODUCTS, f"ddpkit/__init__.py imports {sorted(loaded & PRODUCTS)}"
    assert ddpkit.launch.__module__ == "ddpkit.launchers.spawn"  # still there, when asked for


def test_every_engine_module_is_in_the_independence_contract():
    engines = {f"ddpkit.engines.{p.stem}" for p in (PACKAGE / "engines").glob("*.py")
               if p.stem not in ("__init__", "base", "torchdist",  # the shared parts
                                 "buckets")}  # ddp's first-step comm hook, not an engine
    independent = next(c for c in _contracts() if c["type"] == "independence")
    assert set(independent["modules"]) == engines


@pytest.mark.parametrize("name", [n for n in ddpkit.__all__ if not n.startswith("__")])
def test_every_public_name_has_a_docstring_with_an_example(name):
    doc = inspect.getdoc(getattr(ddpkit, name)) or ""
    assert "Example::" in doc, f"ddpkit.{name} has no 'Example::' in its docstring"


def test_the_public_api_is_about_a_dozen_names_one_spelling_each():
    names = [n for n in ddpkit.__all__ if not n.startswith("__")]
    assert len(names) <= 14 and len(set(names)) == len(names)
    runtime_attrs = {k: v for k, v in vars(ddpkit.Runtime).items() if not k.startswith("_")}
    shared = [k for k, v in runtime_attrs.items() if isinstance(v, staticmethod)]
    for attr in shared:  # a Runtime method that is a library function carries its name
        assert runtime_attrs[attr].__func__.__name__ == attr


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_says_what_it_is_for_and_stays_small(path):
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path.name} has no module docstring"
    assert len(path.read_text().splitlines()) <= 420, f"{path.name} is over ~400 lines"


@pytest.mark.slow
def test_the_readme_blocks_made_from_the_code_are_current():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme.py")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
