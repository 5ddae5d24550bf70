"""The GPU acceptance run's CPU dry run: the checks of bench/gpu/acceptance.py on tiny shapes.

On CPU the trainer under test is the CPU backend, so those checks prove the script and everything up
to the backend keep working between the (rare) GPU sessions; the GPU verdicts are in docs/gpu/. The
SGLang checks are real here: the run uses the suite's sglang venv (``tests/sglang_cpu/env.py``), so
the real ``sglang.Engine`` runs on CPU behind our backend, against transformers and the memory plan.

Two checks are left out here (``--skip``, reported as skipped): ``program/sglang_baseline_vs_tail_batching``,
the program on SGLang in both modes, which the suite already runs with the same bound on every step's
``train/logprob_mismatch_max``: tail batching in tests/integration/test_sglang_real.py and
tests/integration/test_multinode_procs.py (the SGLang tests), the baseline in
tests/integration/test_stale_sync.py (its SGLang run's genuine first step); and its replayed-length
twin ``program/sglang_replay_baseline_vs_tail_batching``, whose one addition, length replay on the
real SGLang engine, the backend section of test_sglang_real.py checks. The same harness
(``check_program``, ``check_replay_program``) still runs here on the reference engine; the GPU run
(``--device cuda``) runs every check.

Two checks run at a time (``--jobs 2``), each in its own process as on the GPU and on a CPU of its
own: sharing both CPUs, the SGLang engine's threads were preempted by the other check's (its check
took 159 s beside another against 35 s alone; 67-81 s on its own CPU, and the run 201-204 s
against 236 s).
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.sglang_cpu.env import REPO, engine_env

COVERED_ELSEWHERE = ["program/sglang_baseline_vs_tail_batching",  # see the module's docstring
                     "program/sglang_replay_baseline_vs_tail_batching"]


@pytest.mark.timeout(1600)  # its own subprocess limit is 1500 s
def test_acceptance_dry_run_passes_every_check_and_writes_its_report(sglang_venv_python, tmp_path):
    proc = subprocess.run([str(sglang_venv_python), "-m", "bench.gpu.acceptance", "--device", "cpu", "--out",
                           str(tmp_path), "--skip", *COVERED_ELSEWHERE, "--jobs", "2"], cwd=REPO, env=engine_env(),
                          capture_output=True, text=True, timeout=1500)
    print(proc.stdout[-4000:])
    results = json.loads((tmp_path / "acceptance.json").read_text())
    failed = {k: v.get("error") or v for k, v in results["checks"].items() if not v["ok"]}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:])
    checks = results["checks"]
    # per-subject checks on the policy only (Sizes.per_subject_on_shape)
    assert len(checks) == 16 and results["skipped"] == COVERED_ELSEWHERE, sorted(checks)
    assert "[acceptance] program/sglang_baseline_vs_tail_batching: skipped (--skip)" in proc.stdout
    assert checks["policy/logprob_parity"]["max_abs_err_vs_hf_fp32"] < 1e-4
    assert checks["policy/gradient_parity"]["fp32"]["rel_l2_err"] < 1e-6  # CPU against itself: identical
    assert checks["policy/engine_greedy_parity"]["equal_tokens"] == checks["policy/engine_greedy_parity"]["tokens"]
    engine = checks["policy/sglang_engine"]
    assert engine["dtype"] == "float32"
    assert engine["kv"]["engine_tokens"] == engine["kv"]["planned_tokens"] == 8192
    assert engine["greedy"]["equal_tokens"] == engine["greedy"]["tokens"] == 8 * 32
    assert engine["push"]["changes_output"] and engine["push"]["equal_tokens"] == 8 * 32
    assert engine["release"]["output_unchanged"]
    moe = checks["tiny-moe/sglang_engine"]  # all-sparse Qwen3-MoE, routing reported: fp32, so exact
    assert moe["greedy"]["equal_tokens"] == moe["greedy"]["tokens"] == moe["push"]["equal_tokens"] == 8 * 32
    assert moe["routing"]["same_order"] == moe["routing"]["positions_x_layers"] > 0, moe["routing"]
    assert checks["tiny-moe/logprob_parity"]["max_abs_err_vs_hf_fp32"] < 1e-4
    rows = checks["tiny-random/sglang_throughput"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["tokens_per_s"] > 0 and r["reference_tokens_per_s"] > 0 for r in rows)
    program = checks["program/baseline_vs_tail_batching"]
    assert program["modes"]["tail_batching"]["steps"] == program["modes"]["baseline"]["steps"] == 2
    for mode in program["modes"].values():
        assert all(b > 0 for b in mode["sync_bytes"]) and mode["sync_ok"], mode
        assert all(0 <= k3 < 1e-6 for k3 in mode["mismatch"]["kl_k3"]), mode["mismatch"]  # fp32 engine and trainer
    replay = checks["program/replay_baseline_vs_tail_batching"]
    assert replay["replay"]["p0"] == 4 and all(m["steps"] == 2 and m["sync_ok"] for m in replay["modes"].values())
    report = (tmp_path / "acceptance.md").read_text()
    assert "| policy/gradient_parity | ok |" in report and "| policy/sglang_engine | ok |" in report
    assert "| program/sglang_baseline_vs_tail_batching | skipped (--skip) |" in report
