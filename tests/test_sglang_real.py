"""The real ``sglang.Engine`` (0.5.23) on CPU, against transformers and against our backend.

The engine runs in a cached venv built by ``sglang_cpu.env`` (first build: about 1.5 minutes). It is
never skipped: if the venv cannot be built, the test fails with pip's reason.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.sglang_cpu.env import REPO, engine_env, sglang_python

CHECKS = Path(__file__).resolve().parent / "sglang_cpu" / "engine_checks.py"
POLICY = REPO / "assets" / "policy"
TIMEOUT_S = 300


@pytest.fixture(scope="session")
def sglang_venv_python() -> Path:
    return sglang_python()


def run_checks(python: Path, mode: str) -> dict:
    try:
        proc = subprocess.run([str(python), str(CHECKS), mode, str(POLICY)], env=engine_env(), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"engine_checks.py {mode} ran past {TIMEOUT_S}s:\n{(exc.output or '')[-4000:]}")
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("VERDICT ")]
    assert verdicts, f"engine_checks.py {mode} printed no verdict (exit {proc.returncode}):\n{proc.stdout[-6000:]}"
    verdict = json.loads(verdicts[-1].removeprefix("VERDICT "))
    assert "crashed" not in verdict, f"engine_checks.py {mode} crashed:\n{verdict['crashed']}\n" \
                                     f"--- output ---\n{proc.stdout[-4000:]}"
    return verdict


def assert_all_true(verdict: dict) -> None:
    failed = {k: v for k, v in verdict.items() if k != "seconds" and v is not True}
    assert not failed, json.dumps(failed, indent=1)


def test_real_engine_greedy_and_weight_update_session(sglang_venv_python):
    """Greedy equals transformers; an update outside begin/end_weight_update is refused (review C1);
    inside the session it lands and greedy equals transformers with the new weights."""
    verdict = run_checks(sglang_venv_python, "engine")
    assert_all_true(verdict)
    assert set(verdict) >= {"greedy_matches_transformers", "update_outside_session_refused",
                            "update_in_session_succeeds", "greedy_after_update_matches_transformers"}


def test_backend_pushes_weights_to_real_engine(sglang_venv_python):
    """``SGLangEngine.update_weights`` on the real engine: generation afterwards equals transformers
    loaded with the pushed weights (fails on a backend that pushes outside the session, C1)."""
    verdict = run_checks(sglang_venv_python, "backend")
    assert_all_true(verdict)
    assert set(verdict) >= {"backend_greedy_matches_transformers", "backend_update_weights_returns",
                            "backend_greedy_after_update_matches_transformers",
                            "backend_raises_when_sglang_refuses"}
