"""Markdown of GPU check results (``bench/gpu/acceptance.py``, ``bench/gpu/run.py``): pure formatting,
importable before the checks' own requirements are installed."""
from __future__ import annotations

from typing import Any


def figures(result: dict[str, Any]) -> str:
    """A check result's scalar figures on one line (its error, if it has one)."""
    return result.get("error") or ", ".join(f"{k}={_fmt(v)}" for k, v in result.items()
                                            if k not in ("ok", "seconds", "traceback") and not isinstance(v, dict)
                                            and not (isinstance(v, list) and len(v) > 12))


def details(checks: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown lines of the checks' nested figures: one line per sub-result, a table per ``rows``."""
    lines: list[str] = []
    for name, r in checks.items():
        for key, value in r.items():
            if isinstance(value, dict):
                lines.append(f"\n**{name} / {key}**: " + ", ".join(f"{k}={_fmt(v)}" for k, v in value.items()
                                                                 if not isinstance(v, (dict, list))))
        if r.get("rows"):
            columns = list(r["rows"][0])
            lines += ["", f"**{name}**", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
            lines += ["| " + " | ".join(_fmt(row[c]) for c in columns) + " |" for row in r["rows"]]
    return lines


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)
