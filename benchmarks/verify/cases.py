"""Run ``ddpkit verify`` over scripts and tabulate verdict, cause, expected cause and time:
the table in benchmarks/RESULTS.md ("verify on planted and held-out bugs").

    python benchmarks/verify/cases.py examples/broken/*.py tests/verify_wild/*.py \
        tests/verify_heldout/*.py --out v.md

A script's expected cause is the `# FAIL [cause]` its docstring names (examples/broken), or the
first docstring line `EXPECT: label` (tests/verify_wild, written by someone who had not seen the
detector; its label is free text, mapped to a cause by hand in EXPECTED below).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Optional

#: The held-out scripts' free-text labels, read and mapped to the cause a user needs named.
EXPECTED = {}


def expected(path: str) -> str:
    name = os.path.basename(path)
    if os.path.basename(os.path.dirname(os.path.abspath(path))) == "verify_heldout":
        # tests/verify_heldout/MANIFEST.md: a bug, its fixed twin, a correct script
        return "FAIL (a bug)" if name.startswith("bug_") else "PASS"
    text = open(path).read()
    m = re.search(r"FAIL \[([\w-]+)\]", text)
    if m:
        return m.group(1)
    m = re.search(r"EXPECT:\s*(.+)", text)
    label = m.group(1).strip() if m else "?"
    return EXPECTED.get(os.path.basename(path), label)


def steps_of(path: str, default: Optional[int]) -> Optional[int]:
    """The --steps a planted script's docstring runs it with (an epoch shorter than 10); else
    ``default`` (None: verify's own default, at most the first epoch)."""
    m = re.search(r"ddpkit verify [^\n]*--steps (\d+)", open(path).read())
    return int(m.group(1)) if m else default


def accum_of(path: str) -> list:
    """The --accum-steps of the docstring line that names the expected FAIL, as arguments."""
    m = re.search(r"ddpkit verify [^\n]*--accum-steps (\d+)[^\n]*# FAIL", open(path).read())
    return ["--accum-steps", m.group(1)] if m else []


def run(path: str, steps: int, timeout: float) -> dict:
    steps = steps_of(path, steps)
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        start = time.monotonic()
        given = (["--steps", str(steps)] if steps is not None else []) + accum_of(path)
        m = re.search(r"ddpkit verify [^\n]*--timeout (\d+)", open(path).read())
        given += ["--timeout", m.group(1)] if m else []  # a planted hang: its own limit
        try:
            proc = subprocess.run([sys.executable, "-m", "ddpkit", "verify", *given,
                                   "--json", report.name, path], capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc = subprocess.CompletedProcess([], -1, "", f"no verdict in {timeout:g} s")
        took = time.monotonic() - start
        data = json.load(open(report.name)) if os.path.getsize(report.name) else {}
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else (proc.stderr.strip().splitlines() or [""])[-1]
    verdict = "PASS" if last.startswith("PASS") else "FAIL" if last.startswith("FAIL") else \
        f"rc {proc.returncode}"
    return {"script": path, "rc": proc.returncode, "verdict": verdict,
            "cause": data.get("cause") or "", "expected": expected(path),
            "evidence": data.get("evidence") or data.get("notes") or [last],
            "seconds": round(took, 1), "line": last, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scripts", nargs="+")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for path in args.scripts:
        row = run(path, args.steps, args.timeout)
        rows.append(row)
        print(f"{row['verdict']:5} {row['cause'] or '-':24} expected {row['expected']:24} "
              f"{row['seconds']:6.1f} s  {path}", flush=True)
    table = ["| script | expected | verdict | cause named | evidence (first line) | steps | s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ev = (r["evidence"][0] if r["evidence"] else "").replace("|", "/")
        table.append(f"| `{r['script']}` | {r['expected']} | {r['verdict']} | "
                     f"{r['cause'] or '-'} | {ev[:160]} | {r['steps'] or 'default'} | {r['seconds']} |")
    if args.out:
        open(args.out, "w").write("\n".join(table) + "\n")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
