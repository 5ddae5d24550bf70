"""`sbatch --wait launch/train.sh` on a Slurm cluster of two nodes emulated on this machine."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from testkit import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))  # the integration tests this one borrows from
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: slurm_cluster.py
from slurm_cluster import LocalSlurm, free_ports, available  # noqa: E402
from test_resume_shipped import assert_no_prompt_lost_or_repeated  # noqa: E402
from test_train_program import FAST  # noqa: E402

pytestmark = pytest.mark.skipif(not (REPO_ROOT / "assets/policy/config.json").exists(),
                                reason="shipped policy missing")


@pytest.fixture(autouse=True)
def slurm_here():
    """Skips where no test cluster can be started, but fails under ``CI=true``: .ci/run installs Slurm
    there and runs as root, so a skip would hide that the launch path went untested."""
    reason = available()
    if reason and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the Slurm launch test cannot run: {reason}")
    if reason:
        pytest.skip(reason)


def test_refuses_to_start_daemons_where_a_slurm_cluster_may_be(monkeypatch):
    """Inside a Slurm job (or beside a running slurmd/slurmctld) the test daemons are never started."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert "SLURM_JOB_ID" in (available() or "")


def _worker(run_dir: Path, rank: int) -> psutil.Process | None:
    """Training rank ``rank`` of the job writing ``run_dir``: a process that torchrun's agent started (its
    parent runs ``rollpacker.launcher``) with ``RANK=rank``; its own children (reward workers) are not."""
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.info["cmdline"] or []
            if f"run.output_dir={run_dir.parent}" in cmdline and "rollpacker.launcher" not in cmdline \
                    and proc.environ().get("RANK") == str(rank) \
                    and "rollpacker.launcher" in psutil.Process(proc.info["ppid"]).cmdline():
                return proc
    return None


def _records(run_dir: Path) -> list[tuple]:
    """Per step: the prompts trained (in any order: groups are recorded as they complete) and what the
    step measured that a redone step must repeat."""
    ledger = [sorted(json.loads(x)["trained"]) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "reward_mean", "generated_tokens", "response_len_max", "train/loss")
    return [(trained, [m[k] for k in keys]) for trained, m in zip(ledger, metrics)]


def test_sbatch_on_two_nodes_trains_and_a_killed_worker_resumes_past_a_damaged_checkpoint(tmp_path):
    """``MAX_RESTARTS=1 sbatch --nodes=2 launch/train.sh``, 2 nodes x 1 rank (the rollout TP kept at 1:
    a TP group never spans nodes), a checkpoint every step, the baseline scheduler (no timing race, so
    a redone step equals the first run of it). Once step 3's checkpoint is complete, rank 1 (on the
    node without rank 0, run by that node's slurmd) is stopped, its file in that checkpoint damaged
    (one byte flipped, size kept) and the rank SIGKILLed. Both nodes' torchrun agents restart their
    workers; rank 1 finds the damage, the ranks agree to skip step 3 and resume from step 2, and the
    job ends with 0, step 3 redone exactly as first run, steps 1-4 logged once, every prompt trained once."""
    started = time.time()

    def log() -> str:
        return "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))

    with LocalSlurm(tmp_path / "slurm", nodes=2) as cluster:
        cluster.env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
                           MASTER_PORT=str(free_ports(1)[0]), MAX_RESTARTS="1", NPROC_PER_NODE="1")
        run_dir = tmp_path / "runs" / "slurm"
        job = cluster.sbatch(
            [f"--output={tmp_path}/slurm-%j.out", "--nodes=2", "launch/train.sh", "configs/tiny-cpu.yaml",
             "run.steps=4", "run.save_every=1", f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}",
             "scheduler.mode=baseline", "scheduler.planner.long_tp=1", "scheduler.planner.max_tp=1", *FAST,
             "run.wandb=disabled"],
            cwd=REPO_ROOT)
        try:
            step3 = run_dir / "checkpoints" / "step_00000003"
            deadline = time.time() + 600
            while not (step3 / "COMPLETE").exists() and job.poll() is None and time.time() < deadline:
                time.sleep(0.01)
            workers = {rank: _worker(run_dir, rank) for rank in range(2)}
            assert (step3 / "COMPLETE").exists() and all(workers.values()), \
                f"no step 4 to kill:\n{log()[-5000:]}\n{cluster.logs()}"
            # torchrun numbers the nodes in the order their agents joined the rendezvous
            node_of = {rank: proc.environ()["SLURMD_NODENAME"] for rank, proc in workers.items()}
            assert sorted(node_of.values()) == ["node0", "node1"], node_of
            victim = workers[1]
            victim.suspend()  # no step 4 checkpoint can complete without it
            assert sorted(p.name for p in step3.parent.iterdir()) == ["step_00000002", "step_00000003"]
            first_step3 = _records(run_dir)[2]
            damaged = step3 / "rank00001.pt"
            data = bytearray(damaged.read_bytes())
            data[len(data) // 2] ^= 0xFF
            damaged.write_bytes(bytes(data))
            victim.kill()
            _, err = job.communicate(timeout=600)
        finally:
            if job.poll() is None:
                job.kill()
        assert job.returncode == 0, f"{err}\n{log()[-5000:]}\n{cluster.logs()}"
    out = log()
    assert "2 node(s) x 1 ranks, rendezvous node0 (127.0.0.1)" in out, out[-3000:]
    # torchrun saw the victim die; the restarted ranks skipped the damaged step 3 for step 2
    failed = out.index(f"failed (exitcode: -9) local_rank: 0 (pid: {victim.pid})")
    skipped = out.index(f"checkpoint step 3 is damaged, skipped: {damaged}: expected", failed)
    assert out.index("resumed from step 2 ", skipped) > skipped
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["groups"] == 4 for r in rows)
    assert_no_prompt_lost_or_repeated(run_dir, steps=4)
    redone = _records(run_dir)[2]
    assert redone[0] == first_step3[0] and redone[1] == pytest.approx(first_step3[1], rel=1e-6, abs=1e-9), \
        (redone, first_step3)
    print(f"2-node sbatch job: ranks on nodes {node_of}; rank 1 killed after step 3 with its step-3 file "
          f"damaged; resumed from step 2, step 3 redone as first run ({redone}), steps 1-4 once; "
          f"{time.time() - started:.0f} s with the cluster's start and stop")
