"""Raw benchmark results, written where the README's figures are read from.

Each file under ``bench/results/`` holds one run: the command that produced it,
the commit it ran on (with ``+dirty`` when the tree had changes), the date
and machine, the load average when it ended, and the benchmark's own payload.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def command() -> str:
    """The command line as typed: ``python -m bench.x ...`` for a module of this repository."""
    script = Path(sys.argv[0]).resolve()
    try:
        head = ["python", "-m", ".".join(script.relative_to(REPO).with_suffix("").parts)]
    except ValueError:
        head = ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def write_results(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": command(), "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_average": os.getloadavg(), **payload}  # 1/5/15 min: how much else ran on the cores
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
