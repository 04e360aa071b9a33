"""The docs site builds strictly (no broken link to a page or an anchor), and README.md stays a
short front page that links every page of the site.

Without mkdocs (the `dev` extra brings mkdocs-material) the build is skipped with the reason, but
in CI (`CI=true`) it fails: the docs must be checked there.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MKDOCS_YML = ROOT / "mkdocs.yml"


def _need_mkdocs():
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        reason = "mkdocs-material is not installed (pip install -e '.[dev]')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}: CI must build the docs")
        pytest.skip(reason)


def _nav_pages():
    """The pages mkdocs.yml's nav lists, in order (``- Title: page.md`` lines)."""
    pages = re.findall(r"^\s*-\s[^\n]*?:\s*(\S+\.md)\s*$", MKDOCS_YML.read_text(), re.M)
    assert pages, "mkdocs.yml has no nav of pages"
    return pages


def test_the_docs_build_strictly(tmp_path):
    _need_mkdocs()
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"


def test_mkdocs_yml_is_strict_and_checks_every_link():
    text = MKDOCS_YML.read_text()
    assert re.search(r"^strict:\s*true\s*$", text, re.M), "mkdocs.yml must set strict: true"
    for check in ("omitted_files", "absolute_links", "unrecognized_links", "anchors"):
        assert re.search(rf"^\s+{check}:\s*warn\s*$", text, re.M), f"validation: {check}: warn"


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = _nav_pages()
    assert len(nav) == len(set(nav)), nav
    on_disk = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == on_disk


def test_the_readme_is_short_and_links_every_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines: move text into docs/"
    text = "\n".join(lines)
    missing = [page for page in _nav_pages() if f"](docs/{page})" not in text]
    assert not missing, f"README.md does not link these docs pages: {missing}"



def _shown_signatures():
    """Each call the Python API page's generated tables show (``public-api``, ``runtime-api``):
    (``ddpkit.NAME`` or ``rt.NAME``, its parameter list)."""
    page = (ROOT / "docs" / "python-api.md").read_text()
    text = "".join(re.findall(r"<!-- generated: (?:public|runtime)-api -->\n(.*?)<!-- end:", page,
                              re.S))
    return re.findall(r"^\| `((?:ddpkit|rt)\.\w+)(\(.*?\))` \|", text, re.M)


def _written(params: str):
    """(name, kind) of each parameter of ``params`` read as Python reads a ``def``."""
    import ast
    from inspect import Parameter as P

    a = ast.parse(f"def f{params}: pass").body[0].args
    return ([(x.arg, P.POSITIONAL_ONLY) for x in a.posonlyargs]
            + [(x.arg, P.POSITIONAL_OR_KEYWORD) for x in a.args]
            + ([(a.vararg.arg, P.VAR_POSITIONAL)] if a.vararg else [])
            + [(x.arg, P.KEYWORD_ONLY) for x in a.kwonlyargs]
            + ([(a.kwarg.arg, P.VAR_KEYWORD)] if a.kwarg else []))


def test_the_python_api_page_shows_keyword_only_parameters_after_a_star():
    shown = dict(_shown_signatures())
    # model is keyword-only: rt.checkpointer("dir", model) raises a TypeError
    assert shown["rt.checkpointer"] == "(directory, *, model, **parts)", shown["rt.checkpointer"]
    assert shown["ddpkit.Checkpointer"].startswith("(rt, directory, *, model, ")
    assert shown["ddpkit.setup"].startswith("(*, backend=None, ")


def test_every_signature_on_the_python_api_page_is_the_code_s():
    """Names and kinds (positional, keyword-only, ``*args``, ``**kwargs``) as the code has them,
    so a call copied from the page is a call Python accepts."""
    import inspect

    import ddpkit

    shown = _shown_signatures()
    assert len(shown) > 20, shown
    for name, params in shown:
        owner, attr = name.split(".")
        obj = getattr(ddpkit.Runtime if owner == "rt" else ddpkit, attr)
        real = [(p.name, p.kind) for p in inspect.signature(obj).parameters.values()
                if not (owner == "rt" and p.name == "self")]
        assert _written(params) == real, name
