"""Suite-wide rule: under ``CI=true`` a skipped test fails the run, unless it is listed below with why.

A skip in CI means a check the README relies on did not run; pytest reports it as a pass-with-note
(``-ra`` prints it), which a green CI run hides. Only skips whose cause CI cannot remove are allowed.
"""
from __future__ import annotations

import os

import pytest

# node id prefix -> why CI may skip it
ALLOWED_CI_SKIPS = {
    "tests/test_trl_bench.py": "TRL is not a dependency: its comparison runs only where a user installed trl",
}

_skipped: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not any(report.nodeid.startswith(p) for p in ALLOWED_CI_SKIPS):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") == "true" and _skipped:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if os.environ.get("CI") == "true" and _skipped:
        terminalreporter.section("skips not allowed in CI (tests/conftest.py ALLOWED_CI_SKIPS)", red=True)
        for nodeid, reason in _skipped:
            terminalreporter.line(f"{nodeid}: {reason}")
