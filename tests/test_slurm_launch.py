"""`sbatch --wait launch/train.sh` on a one-node Slurm cluster started on this machine."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from rollpacker.testing import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import LocalSlurm, available  # noqa: E402
from test_resume_shipped import assert_no_prompt_lost_or_repeated  # noqa: E402
from test_train_program import FAST  # noqa: E402

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.skipif(not (REPO_ROOT / "assets/policy/config.json").exists(), reason="shipped policy missing"),
]


def test_refuses_to_start_daemons_where_a_slurm_cluster_may_be(monkeypatch):
    """Inside a Slurm job (or beside a running slurmd/slurmctld) the test daemons are never started."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert "SLURM_JOB_ID" in (available() or "")


def _worker(run_dir: Path, rank: int) -> psutil.Process | None:
    """Training rank ``rank`` of the job writing ``run_dir``: a process that torchrun started (its
    parent runs ``torch.distributed.run``) with ``RANK=rank``; its own children (reward workers) are not."""
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.info["cmdline"] or []
            if f"run.output_dir={run_dir.parent}" in cmdline and "torch.distributed.run" not in cmdline \
                    and proc.environ().get("RANK") == str(rank) \
                    and "torch.distributed.run" in psutil.Process(proc.info["ppid"]).cmdline():
                return proc
    return None


def test_sbatch_runs_the_example_and_a_killed_worker_restarts_and_resumes(tmp_path):
    """``MAX_RESTARTS=1 sbatch launch/train.sh``: rank 1 killed with SIGKILL after step 2's checkpoint,
    torchrun restarts both workers inside the job, they resume from step 2 and the job ends with 0."""
    cluster = LocalSlurm(tmp_path / "slurm")
    cluster.start()
    job = None
    try:
        cluster.env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
                           MASTER_PORT="29617", MAX_RESTARTS="1")
        run_dir = tmp_path / "runs" / "slurm"
        job = cluster.sbatch(
            [f"--output={tmp_path}/slurm-%j.out", "launch/train.sh", "configs/tiny-cpu.yaml", "run.steps=4",
             "run.save_every=2", f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", *FAST,
             "run.wandb=disabled"], cwd=REPO_ROOT)

        def log() -> str:
            return "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))

        step2 = run_dir / "checkpoints" / "step_00000002" / "COMPLETE"
        deadline = time.time() + 600
        while not step2.exists() and job.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        victim = _worker(run_dir, 1)
        assert step2.exists() and victim, f"no step 3 to kill:\n{log()[-5000:]}\n{cluster.logs()}"
        victim.kill()
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, f"{err}\n{log()[-5000:]}\n{cluster.logs()}"
        out = log()
        assert "rendezvous" in out and "1 node(s) x 2 ranks" in out
        # torchrun saw rank 1 die, then the restarted workers resumed from the checkpoint before it
        failed = out.index(f"failed (exitcode: -9) local_rank: 1 (pid: {victim.pid})")
        assert out.index("resumed from step 2 ", failed) > failed
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["groups"] == 4 for r in rows)
        assert_no_prompt_lost_or_repeated(run_dir, steps=4)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        cluster.stop()
