"""Code: the response's last fenced Python block, run in the sandbox on each test case.

Reward 1 only if every case's output matches (trailing whitespace per line and
trailing blank lines ignored).  Cases run in order and scoring stops at the
first failure, so a wrong program costs one case, not all of them.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from rollpacker.reward.sandbox import RUN_CRASH, RUN_OK, RUN_TIMEOUT, RUN_VIOLATION, SandboxLimits, run_python
from rollpacker.reward.score import CRASH, NO_ANSWER, SANDBOX_VIOLATION, TIMEOUT, WRONG_ANSWER, Score

_FENCE = re.compile(r"^```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL | re.IGNORECASE)
_REASON = {RUN_TIMEOUT: TIMEOUT, RUN_VIOLATION: SANDBOX_VIOLATION, RUN_CRASH: CRASH}


@dataclass(frozen=True)
class TestCase:
    stdin: str
    stdout: str


def parse_tests(tests: Any) -> tuple[TestCase, ...]:
    """Validate a code label: a non-empty list of {"stdin": str, "stdout": str}."""
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"code tests must be a non-empty list of {{'stdin', 'stdout'}} objects, got {tests!r:.80}")
    cases = []
    for i, case in enumerate(tests):
        if not isinstance(case, dict) or not isinstance(case.get("stdin"), str) \
                or not isinstance(case.get("stdout"), str):
            raise ValueError(f"code test {i} must be {{'stdin': str, 'stdout': str}}, got {case!r:.80}")
        cases.append(TestCase(case["stdin"], case["stdout"]))
    return tuple(cases)


def extract_program(response: str) -> str | None:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def outputs_match(actual: str, expected: str) -> bool:
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]
    return norm(actual) == norm(expected)


def score_code(response: str, cases: tuple[TestCase, ...], timeouts: tuple[float, ...],
               limits: SandboxLimits, on_start: Callable[[int], None] | None = None) -> tuple[Score, dict[int, float]]:
    """The score, and the runtime in seconds of each case the program passed, by index.
    ``on_start`` gets the pid of each run's program (see ``run_python``)."""
    start = time.monotonic()
    program = extract_program(response)
    if program is None:
        return Score.failed(NO_ANSWER, "no fenced python block in the response"), {}
    passed: dict[int, float] = {}
    for i, (case, timeout) in enumerate(zip(cases, timeouts, strict=True)):
        run = run_python(program, case.stdin, timeout, limits, on_start)
        if run.status != RUN_OK:
            detail = f"test {i}: {run.detail}"
            return Score.failed(_REASON[run.status], detail, time.monotonic() - start), passed
        if not outputs_match(run.stdout, case.stdout):
            return Score.failed(WRONG_ANSWER, f"test {i}: output differs", time.monotonic() - start), passed
        passed[i] = run.seconds
    return Score.passed(time.monotonic() - start), passed
