"""Resume, proven as shipped: the tiny-cpu program killed at several points, resumed each time.

One run directory, one command line (``configs/tiny-cpu.yaml`` with the suite's FAST overrides:
P0=R0=4, so steps 1-4 are short rounds that each defer one prompt to the long-prompt queue and
step 5 is a long round of those 4, whose second engine leaves for the stream trainer, as the
shipped profile makes it). The run is interrupted four times and the same command resumes it. Each
interruption lands at an exact point: the launch runs ``tests/dist/train_stop_at.py``, the shipped
program on which the rank to be signalled stops itself (SIGSTOP) at the named point, and the test
signals it there:

1. kill -9 rank 1 as it enters step 3's rollout, a short round (after step 2's row and checkpoint);
2. kill -9 rank 1 in step 5, the long round, as its stream trainer is handed its first group. The
   round's prompts were popped from the long-prompt queue, so only rank 0's memory and step 4's
   checkpoint (whose queue holds the 4) have them;
3. kill -9 rank 0 once it has written its state into step 6's checkpoint (``step_00000006.tmp``
   holds it, no ``COMPLETE``): the resume uses step 4's and discards the torn directory;
4. SIGTERM rank 1 as it enters step 7's rollout: every rank checkpoints at the end of step 7 (not a
   multiple of ``save_every``) and the launcher exits 0; the last launch runs steps 8-10 unstopped.

The ledger then shows every (uid, epoch) trained at most once, nothing filtered twice, and every
prompt the data served (read back from the final checkpoint's data cursor) trained, filtered or
still in the saved long-prompt queue. Metric equality with an uninterrupted run is not asserted
here: tail batching races on a real clock, so which prompts win a short round (and so the rewards,
losses and lengths) depends on timing even without a restart. What does not depend on timing is
asserted: one row per step, the round kinds, the queue length and the groups of every step.
``test_train_program.test_kill9_then_resume_loses_and_repeats_no_prompt`` checks metric equality
after a kill in baseline mode, which has no race.

The launcher's own SIGTERM is not used: torchrun forwards it to the workers, SIGKILLs them after
its ``--shutdown_timeout`` (30 s) and exits non-zero whatever they do. Slurm's ``scancel`` signals
every process of the step, workers included, which is the case tested here.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollpacker.runtime.ledger import read_ledger
from testkit import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))  # the integration tests this one borrows from
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: procgroup.py
from procgroup import kill_group  # noqa: E402
from test_train_program import FAST, POLICY  # noqa: E402

pytestmark = pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="shipped policy missing")

STEPS = ["run.steps=10", "run.save_every=2", "run.wandb=disabled"]


class Launch:
    """One `torchrun` of the run's command, its output in a file of the test's own. With ``stop``
    (point, rank, step), that rank stops itself there (tests/dist/train_stop_at.py)."""

    def __init__(self, run_dir: Path, log: Path, stop: tuple[str, int, int] | None = None):
        self.run_dir, self.log = run_dir, log
        self.marker = log.with_suffix(".stopped")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        program = ["-m", "rollpacker.train"]
        if stop is not None:
            env.update(STOP_AT=stop[0], STOP_RANK=str(stop[1]), STOP_STEP=str(stop[2]), STOP_MARKER=str(self.marker))
            program = [str(REPO_ROOT / "tests" / "dist" / "train_stop_at.py")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *program,
               "--config", "configs/tiny-cpu.yaml", f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}",
               *FAST, *STEPS]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def stopped(self, timeout: float = 300) -> int:
        """The pid of the rank stopped at this launch's point, once it has stopped there. The stop lasts
        until the test signals it, so how often this looks does not matter."""
        deadline = time.monotonic() + timeout
        while not (self.marker.exists() and _state(int(self.marker.read_text())) == "T"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"no rank stopped (rc {self.proc.returncode}):\n{self.output()[-4000:]}")
            time.sleep(0.1)
        return int(self.marker.read_text())

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self) -> None:
        """Whatever this launch started and left running: its process group (a session of its own),
        e.g. the reward workers of a rank 0 killed by -9."""
        kill_group(self.proc)


def _state(pid: int) -> str:
    """The process state letter (T: stopped), or "" once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _complete(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE").exists()


def _latest(run_dir: Path) -> int:
    done = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")
            if not p.name.endswith(".tmp") and (p / "COMPLETE").exists()]
    return max(done, default=0)


def _rows(run_dir: Path) -> list[dict]:
    """The training steps' lines (the shipped config's evals log lines of their own, without a round)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "round" in r]


def _shared(run_dir: Path, step: int) -> dict:
    import torch

    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}" / "shared.pt", weights_only=False)


def assert_no_prompt_lost_or_repeated(run_dir: Path, steps: int) -> None:
    """The ledger of a tiny-cpu run with P0=4 (FAST) that ended with a checkpoint at ``steps``: one
    line per step, each (uid, epoch) trained at most once, nothing filtered twice, and every prompt
    the data served (read back from that checkpoint's data cursor) trained, filtered or still in its
    long-prompt queue."""
    lines = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    trained, filtered = read_ledger(run_dir / "ledger.jsonl")
    assert max(trained.values()) == 1 and max(filtered.values(), default=1) == 1
    assert not set(trained) & set(filtered)
    assert all(len(x["trained"]) == 4 for x in lines) and len(trained) == 4 * steps

    from rollpacker.config import load_config
    from rollpacker.data.dataset import PromptDataset
    from rollpacker.runtime.preflight import load_tokenizer

    cfg = load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml").resolve(REPO_ROOT)
    data = PromptDataset.from_config(cfg.data, load_tokenizer(cfg.model.path, cfg.source))
    shared = _shared(run_dir, steps)
    cursor = shared["data"]
    served = [(p.uid, p.epoch) for p in data.take(cursor["epoch"] * len(data) + cursor["position"])]
    queued = [(p["uid"], p["epoch"]) for p in shared["scheduler"]["queue"]["prompts"]]
    assert len(set(served)) == len(served) == len(trained) + len(filtered) + len(queued)
    assert set(served) == set(trained) | set(filtered) | set(queued)


def test_killed_at_every_point_resumes_without_losing_or_repeating_a_prompt(tmp_path):
    run_dir = tmp_path / "runs" / "resume"
    run_dir.parent.mkdir()
    launches: list[Launch] = []

    def launch(stop: tuple[str, int, int] | None = None) -> Launch:
        launches.append(Launch(run_dir, tmp_path / f"launch{len(launches) + 1}.log", stop))
        return launches[-1]

    def killed(run: Launch, resumed_from: int | None) -> None:
        assert run.wait() != 0, run.output()[-3000:]
        if resumed_from is not None:
            assert f"resumed from step {resumed_from} " in run.output()

    try:
        # 1. kill -9 rank 1 in step 3, a short round
        run = launch(("rollout", 1, 3))
        os.kill(run.stopped(), signal.SIGKILL)
        killed(run, None)
        assert _latest(run_dir) == 2 and max(r["step"] for r in _rows(run_dir)) == 2

        # 2. kill -9 rank 1 while it stream-trains in step 5's long round
        run = launch(("stream_train", 1, 5))
        os.kill(run.stopped(), signal.SIGKILL)
        assert max(r["step"] for r in _rows(run_dir)) == 4
        killed(run, 2)
        queue = _shared(run_dir, 4)["scheduler"]["queue"]["prompts"]
        assert len(queue) == 4, queue  # the four deferred prompts, which step 5 took

        # 3. kill -9 rank 0 while step 6's checkpoint is written
        torn = run_dir / "checkpoints" / "step_00000006.tmp"
        run = launch(("checkpoint", 0, 6))
        pid = run.stopped()
        assert (torn / "rank00000.pt").exists() and not (torn / "COMPLETE").exists()
        os.kill(pid, signal.SIGKILL)
        killed(run, 4)
        assert torn.is_dir() and not (torn / "COMPLETE").exists() and _latest(run_dir) == 4

        # 4. SIGTERM rank 1 in step 7: checkpoint at the end of the step, exit 0
        run = launch(("rollout", 1, 7))
        pid = run.stopped()
        assert _complete(run_dir, 6) and not _complete(run_dir, 7)
        os.kill(pid, signal.SIGTERM)  # pending while stopped, handled once continued
        os.kill(pid, signal.SIGCONT)
        assert run.wait() == 0, run.output()[-3000:]
        assert "SIGTERM received by another rank: checkpointing this step, then exit" in run.output()
        assert "resumed from step 4 " in run.output()
        assert _latest(run_dir) == 7 and max(r["step"] for r in _rows(run_dir)) == 7

        # the rest of the run
        run = launch()
        assert run.wait() == 0, run.output()[-3000:]
        assert "resumed from step 7 " in run.output()
    finally:
        for run in launches:
            run.stop()

    assert_no_prompt_lost_or_repeated(run_dir, steps=10)

    # What does not depend on timing equals an uninterrupted run's: one row per step, 4 short rounds
    # (5 prompts raced, 4 kept, 1 deferred) then a long round of the 4 deferred, streamed.
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [r["round"] for r in rows] == (["short"] * 4 + ["long"]) * 2
    assert [r["queue_length"] for r in rows] == [1, 2, 3, 4, 0] * 2
    assert all(r["groups"] == 4 and r["responses_kept"] == 16 for r in rows)
    assert all(r["streamed_groups"] > 0 for r in rows if r["round"] == "long")
