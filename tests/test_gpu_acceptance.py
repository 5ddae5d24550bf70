"""The GPU acceptance run's CPU dry run: every check of bench/gpu_acceptance.py on tiny shapes.

On CPU the backend under test is the CPU one, so this proves the script and everything up to the
backend keep working between the (rare) GPU sessions; the GPU verdicts are in docs/gpu/.
"""
from __future__ import annotations

import json
import subprocess
import sys

from rollpacker.testing import REPO_ROOT


def test_acceptance_dry_run_passes_every_check_and_writes_its_report(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_acceptance", "--device", "cpu", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    results = json.loads((tmp_path / "acceptance.json").read_text())
    failed = {k: v.get("error") for k, v in results["checks"].items() if not v["ok"]}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:])
    assert len(results["checks"]) == 15
    checks = results["checks"]
    assert checks["policy/logprob_parity"]["max_abs_err_vs_hf_fp32"] < 1e-4
    assert checks["policy/gradient_parity"]["fp32"]["rel_l2_err"] < 1e-6  # CPU against itself: identical
    assert checks["policy/engine_greedy_parity"]["equal_tokens"] == checks["policy/engine_greedy_parity"]["tokens"]
    program = checks["program/baseline_vs_tail_batching"]
    assert program["modes"]["tail_batching"]["steps"] == program["modes"]["baseline"]["steps"] == 2
    assert "| policy/gradient_parity | ok |" in (tmp_path / "acceptance.md").read_text()
