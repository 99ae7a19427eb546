"""Runs every command the user-facing docs show, as written and in order, in this checkout (a fresh
clone in CI, after the tests): the fenced ``bash`` blocks of README.md, docs/getting-started.md,
docs/training.md and docs/data.md, a line at a time (a line ending in ``\\`` goes on), with
.venv/bin first on PATH as after ``source .venv/bin/activate``. A command that fails fails the check.

    python scripts/check_docs.py [--list] [--only DOC]

Some lines cannot run here, or run too long as written; `RULES` says which and why, in one place:
each is skipped or shortened (arguments added to the end, as a user would), and the report says so.
docs/benchmarks.md is left out whole: each of its commands is a benchmark of minutes to hours,
and the suite runs their smoke versions (tests/test_bench_smoke.py)."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/getting-started.md", "docs/training.md", "docs/data.md"]
TIMEOUT_S = 1200


@dataclass(frozen=True)
class Rule:
    """Lines matching `pattern`: skipped for `reason` (`extra` None), or run with `extra` appended."""

    pattern: str
    reason: str
    extra: Optional[str] = None


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


RULES = [
    Rule(r"scripts/(setup|test)\.sh|^pip install", "CI ran it before this check"),
    Rule(r"/data/|/scratch/|<[a-z ]+>", "the reader's own data or hosts"),
    *([] if _gpus() else [Rule(r"device=cuda|gpu_check", "needs a GPU")]),
    *([] if _gpus() >= 8 else [Rule(r"--nproc_per_node 8 .*device=cuda", "needs 8 GPUs")]),
    Rule(r"configs/synthetic_large\.yaml", "2,000 steps as written: the check trains 40",
         "train.steps=40 eval.every=40 output_dir=runs/synthetic_large"),
]


def commands(doc: Path) -> List[Tuple[int, str]]:
    """(line number, command) of each command in the doc's ``bash`` blocks, in order."""
    found, lines = [], doc.read_text().splitlines()
    inside, pending, start = False, "", 0
    for number, line in enumerate(lines, start=1):
        if line.strip().startswith("```"):
            inside = line.strip() == "```bash" if not inside else False
            continue
        if not inside:
            continue
        text = line.strip()
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        command = (pending + text).strip()
        pending = ""
        if command and not command.startswith("#"):
            found.append((start, command))
    return found


def rule_for(command: str) -> Optional[Rule]:
    return next((r for r in RULES if re.search(r.pattern, command)), None)


def run(command: str) -> Tuple[int, float, str]:
    """(exit code, seconds, the output's last lines) of `command` in bash, in the repository."""
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(REPO / ".venv")}
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, output = 124, f"timed out after {TIMEOUT_S} s\n{e.stderr or ''}"
    return code, time.monotonic() - started, "\n".join(str(output).splitlines()[-30:])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the commands and what the check does with "
                                                            "each, run nothing")
    parser.add_argument("--only", choices=DOCS, help="one doc's commands alone")
    args = parser.parse_args(argv)
    failed = []
    for doc in [args.only] if args.only else DOCS:
        for number, command in commands(REPO / doc):
            rule = rule_for(command)
            where = f"{doc}:{number}"
            if rule is not None and rule.extra is None:
                print(f"[docs] {where}: skipped ({rule.reason}): {command}", flush=True)
                continue
            if rule is not None:
                command = re.sub(r"\s+#.*$", "", command) + " " + rule.extra
                print(f"[docs] {where}: shortened ({rule.reason})", flush=True)
            if args.list:
                print(f"[docs] {where}: {command}", flush=True)
                continue
            code, seconds, tail = run(command)
            print(f"[docs] {where}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f} s: {command}",
                  flush=True)
            if code:
                print(tail, flush=True)
                failed.append(where)
    if failed:
        print(f"[docs] {len(failed)} command(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
