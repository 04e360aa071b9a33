"""The generated blocks of README.md and the docs pages, made from the code so they cannot drift.

    python scripts/readme.py           # check: exit 1 and name each block that differs
    python scripts/readme.py --write   # rewrite those blocks where they are

A block sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->`` in README.md or in
any page under docs/ (``docs/**/*.md``). Each name in ``BLOCKS`` appears exactly once across those
files; a name that is not in ``BLOCKS``, a name that appears twice, and a name that appears nowhere
are errors (exit 1), in both modes. tests/test_layout.py runs the check in ``make test``.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import io
import os
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "ddpkit"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)",
                   re.S)

#: The sbatch example: this command, and what it prints.
SBATCH_ARGS = ["slurm", "--nodes", "2", "--gpus-per-node", "4", "--time", "02:00:00",
               "--rdzv-timeout", "300", "--max-restarts", "1", "train.py", "--epochs", "90"]

#: The Kubernetes examples: these commands, and what they print.
K8S_ARGS = ["k8s", "--nodes", "2", "--gpus-per-node", "8", "--image", "ghcr.io/me/train:1",
            "--cpu", "32", "--memory", "256Gi", "--pvc", "ckpt:/ckpt", "train.py", "--epochs",
            "90", "--out", "/ckpt/run"]
TRAINJOB_ARGS = K8S_ARGS[:1] + ["--kind", "trainjob"] + K8S_ARGS[1:]


def _fenced(lang: str, text: str) -> str:
    return f"```{lang}\n{text.rstrip()}\n```\n"


def _diff(before: str, after: str) -> str:
    plain = (ROOT / before).read_text().splitlines(keepends=True)
    ours = (ROOT / after).read_text().splitlines(keepends=True)
    return _fenced("diff", "".join(difflib.unified_diff(plain, ours, before, after, n=1)))


#: Each conversion the README shows: (name, plain script, ddpkit script, what the diff does).
CONVERSIONS = [
    ("README example", "train", "setup, wrap, loader, to_device, print0, exact evaluation"),
    ("language model", "lm", "the same; a 9-line validation loop becomes 3 lines"),
    ("ImageNet-style", "imagenet", "the hand-written resume (epoch boundaries only) and "
     "`validate()`'s meters give way to the checkpointer (exact, mid-epoch) and one `rt.evaluate`"),
    ("nanoGPT-style", "gpt", "per-rank seeds and the accumulation split as nanoGPT does, "
     "`no_sync`, the checkpointer instead of `init_from='resume'`'s loading, losses as `rt.mean`"),
]


def _changed(before: str, after: str) -> tuple:
    plain = (ROOT / before).read_text().splitlines()
    ours = (ROOT / after).read_text().splitlines()
    lines = list(difflib.unified_diff(plain, ours, n=0, lineterm=""))[2:]
    added = sum(1 for line in lines if line.startswith("+"))
    return added, sum(1 for line in lines if line.startswith("-"))


def conversion_counts() -> str:
    """Lines added and removed by each conversion, counted from the files themselves, and the
    range of changed lines the prose beside it quotes (so that sentence cannot drift either)."""
    rows = ["| conversion | added | removed | changed | what the diff does |",
            "|---|---|---|---|---|"]
    changed = []
    for name, stem, what in CONVERSIONS:
        added, removed = _changed(f"examples/{stem}_plain.py", f"examples/{stem}_ddpkit.py")
        changed.append(added + removed)
        rows.append(f"| {name} (`{stem}_*`) | {added} | {removed} | {added + removed} | {what} |")
    rows.append(f"\nThe examples here change {min(changed)} to {max(changed)} lines.")
    return "\n".join(rows) + "\n"


def example_diff() -> str:
    """The whole diff between the plain example and the ddpkit one."""
    return _diff("examples/train_plain.py", "examples/train_ddpkit.py")


def home_example() -> str:
    """The README example's ddpkit side, for the docs' home page: ``import ddpkit`` and the body
    of ``main()`` in examples/train_ddpkit.py from ``ddpkit.setup`` on, its five numbered lines
    among the lines they change (the file the README's diff and the tests run)."""
    lines = (ROOT / "examples" / "train_ddpkit.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "ddpkit.setup(" in line)
    end = next(i for i in range(start, len(lines)) if lines[i] and not lines[i][0].isspace())
    text = "import ddpkit\n\n" + "\n".join(line[4:] for line in lines[start:end])
    marked = [str(n) for n, line in enumerate(text.splitlines(), 1) if re.search(r"# \d: ", line)]
    return _fenced(f'python hl_lines="{" ".join(marked)}"', text)  # the five lines highlighted


def lm_diff() -> str:
    """The whole diff between the plain language model and its ddpkit conversion."""
    return _diff("examples/lm_plain.py", "examples/lm_ddpkit.py")


def imagenet_diff() -> str:
    """The whole diff between the imagenet/main.py-shaped script and its ddpkit conversion."""
    return _diff("examples/imagenet_plain.py", "examples/imagenet_ddpkit.py")


def gpt_diff() -> str:
    """The whole diff between the nanoGPT-shaped script and its ddpkit conversion."""
    return _diff("examples/gpt_plain.py", "examples/gpt_ddpkit.py")


def _cli(args: List[str]) -> str:
    from ddpkit.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        main(args)
    return out.getvalue()


def sbatch() -> str:
    """``ddpkit slurm ...`` and the script it prints."""
    return _fenced("bash", f"$ ddpkit {' '.join(SBATCH_ARGS)}\n{_cli(SBATCH_ARGS)}")


def k8s_indexed_job() -> str:
    """``ddpkit k8s ...`` (an Indexed Job and its headless Service) and the YAML it prints."""
    return _fenced("yaml", f"# $ ddpkit {' '.join(K8S_ARGS)}\n{_cli(K8S_ARGS)}")


def k8s_trainjob() -> str:
    """``ddpkit k8s --kind trainjob ...`` and the TrainJob it prints."""
    return _fenced("yaml", f"# $ ddpkit {' '.join(TRAINJOB_ARGS)}\n{_cli(TRAINJOB_ARGS)}")


def _usage(command: str) -> str:
    from ddpkit.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps usage at the terminal width
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[command].format_usage().replace("usage: ", "", 1)


def run_usage() -> str:
    """The usage lines of ``ddpkit run``."""
    return _fenced("", _usage("run"))


def _md(rst: str, cell: bool = True) -> str:
    """First paragraph of a docstring as one Markdown line (roles and double backticks dropped);
    ``cell``: for a table's cell, its ``|`` escaped."""
    text = " ".join(rst.split("\n\n")[0].split())
    text = re.sub(r":\w+:`~?\.?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|") if cell else text


def _summary(path: Path) -> str:
    return _md(ast.get_docstring(ast.parse(path.read_text())) or "", cell=False)


def _param(p: inspect.Parameter) -> str:
    if p.kind is p.VAR_POSITIONAL:
        return "*" + p.name
    if p.kind is p.VAR_KEYWORD:
        return "**" + p.name
    if p.default is p.empty:
        return p.name
    return f"{p.name}={repr(p.default).replace('datetime.', '')}"


def _signature(obj: object) -> str:
    """The call as Python writes it, markers kept: ``/`` after the positional-only parameters,
    ``*`` before the keyword-only ones (``rt.checkpointer(directory, *, model, **parts)``: a
    ``model`` passed by position is a TypeError, so the page must not show it as positional)."""
    try:
        params = list(inspect.signature(obj).parameters.values())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    parts: List[str] = []
    star = False  # a `*` (bare or `*args`) already stands before the keyword-only parameters
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY)
        parts.append(_param(p))
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params)
                                            or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def module_map() -> str:
    """Every module of the package, a section per folder: the core's flat modules first, then each
    folder under a heading of its own, opened by its ``__init__.py``'s docstring, its modules
    listed below it, each with the first paragraph of its docstring."""
    folders: Dict[str, List[Path]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__main__.py":
            folders.setdefault(path.parent.relative_to(PACKAGE).as_posix(), []).append(path)
    out: List[str] = []
    for folder in sorted(folders, key=lambda f: (f != ".", f)):
        name = "ddpkit/" if folder == "." else f"ddpkit/{folder}/"
        init = PACKAGE / folder / "__init__.py"
        out.append(f"### `{name}`\n\n{_summary(init)}\n")
        for path in folders[folder]:
            if path.name != "__init__.py":
                out.append(f"- `{path.name}`: {_summary(path)}")
        out.append("")
    return "\n".join(out)


def public_api() -> str:
    """``ddpkit.__all__``: each name with its signature and the first line of its docstring."""
    import ddpkit

    rows = ["| name | what it does |", "|---|---|"]
    for name in ddpkit.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(ddpkit, name)
        sig = "" if isinstance(obj, type) and issubclass(obj, Exception) else _signature(obj)
        rows.append(f"| `ddpkit.{name}{sig}` | {_md(inspect.getdoc(obj) or '')} |")
    return "\n".join(rows) + "\n"


def runtime_api() -> str:
    """Every public method and property of ``ddpkit.Runtime`` (what ``setup()`` returns)."""
    from ddpkit import Runtime

    rows = ["| `rt.` | what it does |", "|---|---|"]
    for name, member in sorted(vars(Runtime).items()):
        if name.startswith("_"):
            continue
        doc = inspect.getdoc(member) or ""
        if "deprecated" in doc.lower().split(".")[0]:
            continue
        sig = "" if isinstance(member, property) else _signature(member).replace("(self, ", "(") \
            .replace("(self)", "()")
        rows.append(f"| `rt.{name}{sig}` | {_md(doc)} |")
    return "\n".join(rows) + "\n"


#: Each block by name: the function that makes it. ``example-diff`` is the README's; ``train-diff``
#: is the same diff on the docs site's "Convert your script" page (names are unique across files).
BLOCKS: Dict[str, Callable[[], str]] = {"example-diff": example_diff, "train-diff": example_diff,
                                        "home-example": home_example,
                                        "lm-diff": lm_diff, "imagenet-diff": imagenet_diff,
                                        "gpt-diff": gpt_diff,
                                        "conversion-counts": conversion_counts,
                                        "runtime-api": runtime_api, "sbatch": sbatch,
                                        "run-usage": run_usage, "module-map": module_map,
                                        "public-api": public_api,
                                        "k8s-indexed-job": k8s_indexed_job,
                                        "k8s-trainjob": k8s_trainjob}


def files() -> List[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [README] + sorted(DOCS.rglob("*.md"))


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def locate(paths: List[Path]) -> Dict[str, Path]:
    """Where each generated block is: its name to the one file that holds it. Raises SystemExit
    (exit 1) naming an unknown block, or a block that appears more than once."""
    where: Dict[str, Path] = {}
    for path in paths:
        for match in BLOCK.finditer(path.read_text()):
            name = match.group("name")
            if name not in BLOCKS:
                raise SystemExit(f"{_name(path)}: unknown generated block {name!r}")
            if name in where:
                raise SystemExit(f"generated block {name!r} appears twice: in {_name(where[name])}"
                                 f" and in {_name(path)}; each block belongs in one file")
            where[name] = path
    return where


def render(text: str) -> str:
    """``text`` with every generated block made anew."""
    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"unknown generated block {name!r}")
        return match.group(1) + BLOCKS[name]() + match.group(4)
    return BLOCK.sub(fill, text)


def stale(text: str) -> List[str]:
    """Names of the blocks in ``text`` whose body differs from what the code makes now."""
    return [m.group("name") for m in BLOCK.finditer(text)
            if m.group("name") not in BLOCKS or BLOCKS[m.group("name")]() != m.group("body")]


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale blocks")
    ns = parser.parse_args(argv)
    paths = files()
    where = locate(paths)
    missing = [name for name in BLOCKS if name not in where]
    found = {path: stale(path.read_text()) for path in paths}
    found = {path: names for path, names in found.items() if names}
    if ns.write:
        for path, names in found.items():
            path.write_text(render(path.read_text()))
            print(f"{_name(path)}: rewrote {', '.join(names)}")
        if not found:
            print("generated blocks: rewrote nothing (all current)")
    elif found:
        where_stale = "; ".join(f"{_name(path)}: {', '.join(names)}"
                                for path, names in found.items())
        print(f"stale generated blocks in {where_stale}; run python scripts/readme.py --write",
              file=sys.stderr)
    if missing:
        print(f"generated block(s) {', '.join(missing)} appear in no file (README.md, docs/*.md): "
              f"put <!-- generated: NAME --> ... <!-- end: NAME --> where each belongs",
              file=sys.stderr)
        return 1
    return 1 if found and not ns.write else 0


if __name__ == "__main__":
    sys.exit(main())
