"""Controls for the weight-sync checks: a run whose syncs go stale must fail the checks the real runs pass.

``tests/dist/stale_sync.py`` runs the program with every sync after the first re-sending the first
one's tensors. The real runs (tests/integration/test_train_program.py, tests/integration/test_sglang_real.py) assert
``sync/max_abs_diff == 0`` and ``train/logprob_mismatch_max`` (the largest per-token gap) under its bound
every step; here the same bounds must be broken from step 2 on, and held at step 1 (its sync is
genuine), so the checks can fail.
"""
from __future__ import annotations

import json
from pathlib import Path

from tests.bounds import CPU_SYNC_BOUND
from testkit import free_base_port, run_torchrun
from tests.integration.test_sglang_real import PROGRAM_TIMEOUT_S, run_in_venv
from tests.integration.test_train_program import FAST

STALE = "tests/dist/stale_sync.py"
MISMATCH_BOUND = CPU_SYNC_BOUND  # the real runs' bound on train/logprob_mismatch_max


def _rows(run_dir: Path) -> dict[int, dict]:
    lines = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in lines if "round" in r}


def test_a_stale_sync_fails_the_reference_engines_checks(tmp_path):
    run_dir = tmp_path / "stale"
    run_torchrun(2, [STALE, "--config", "configs/tiny-cpu.yaml", f"run.output_dir={tmp_path}", "run.name=stale",
                     *FAST, "run.steps=2", "run.save_every=0", "run.verify_sync=true", "run.wandb=disabled"])
    rows = _rows(run_dir)
    print({s: (r["sync/max_abs_diff"], r["train/logprob_mismatch_max"]) for s, r in rows.items()})
    assert rows[1]["sync/max_abs_diff"] == 0.0 and rows[1]["train/logprob_mismatch_max"] < MISMATCH_BOUND
    assert rows[2]["sync/max_abs_diff"] > 0.0
    assert rows[2]["train/logprob_mismatch_max"] > 10 * MISMATCH_BOUND


def test_a_stale_sync_fails_the_sglang_runs_check(sglang_venv_python, tmp_path):
    """In the baseline mode: the suite's run of that mode on SGLang (tail batching on SGLang runs in
    tests/integration/test_sglang_real.py and tests/integration/test_multinode_procs.py), whose step 1
    passes the real runs' check."""
    run_dir = tmp_path / "stale"
    cmd = [str(sglang_venv_python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", STALE,
           "--config", "configs/tiny-cpu.yaml", "rollout.backend=sglang", *FAST, "run.steps=2", "run.save_every=0",
           "run.wandb=disabled", "scheduler.planner.enabled=false", "rollout.tp=1",
           "scheduler.mode=baseline", f"run.output_dir={tmp_path}", "run.name=stale", f"rollout.sglang_base_port={free_base_port(1, 2, local_ranks=2)}",
           # 8 prompts: a prompt's responses share an engine, and 4 groups of the confident tiny policy
           # can all score alike, which leaves step 1 no update for a stale sync to miss
           "scheduler.p0=8"]
    proc = run_in_venv(cmd, "stale-sync program on sglang", PROGRAM_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-8000:]
    rows = _rows(run_dir)
    print({s: (r["round"], r["train/logprob_mismatch_max"]) for s, r in rows.items()})
    assert [r["round"] for r in rows.values()] == ["baseline", "baseline"]
    assert rows[1]["train/grad_norm"] > 0, "step 1 updated nothing: the control would prove nothing"
    assert rows[1]["train/logprob_mismatch_max"] < MISMATCH_BOUND and rows[1]["responses_kept"] == 32
    assert rows[2]["train/logprob_mismatch_max"] > 10 * MISMATCH_BOUND
