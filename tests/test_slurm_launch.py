"""`sbatch --wait launch/train.sh` on a one-node Slurm cluster started on this machine."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from rollpacker.testing import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import LocalSlurm, available  # noqa: E402

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.skipif(not (REPO_ROOT / "assets/policy/config.json").exists(), reason="shipped policy missing"),
]


def test_refuses_to_start_daemons_where_a_slurm_cluster_may_be(monkeypatch):
    """Inside a Slurm job (or beside a running slurmd/slurmctld) the test daemons are never started."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert "SLURM_JOB_ID" in (available() or "")


def test_sbatch_runs_the_example_and_writes_metrics(tmp_path):
    cluster = LocalSlurm(tmp_path / "slurm")
    cluster.start()
    try:
        cluster.env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
                           MASTER_PORT="29617")
        run_dir = tmp_path / "runs" / "slurm"
        proc = cluster.sbatch(
            [f"--output={tmp_path}/slurm-%j.out", "launch/train.sh", "configs/tiny-cpu.yaml", "run.steps=2",
             f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", "scheduler.p0=4", "scheduler.r0=4",
             "rollout.max_response_length=256", "reward.num_workers=1", "run.wandb=disabled"],
            cwd=REPO_ROOT, timeout=900)
        log = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
        assert proc.returncode == 0, f"{proc.stderr}\n{log[-5000:]}\n{cluster.logs()}"
        assert "rendezvous" in log and "1 node(s) x 2 ranks" in log
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["groups"] == 4 for r in rows)
    finally:
        cluster.stop()
