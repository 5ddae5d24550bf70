"""What a person running ``rollpacker-train`` sees: the console of a short run of the shipped example,
a rerun of the finished run, Ctrl-C, and each refusal as one message without a traceback.

The runs go through ``python -m rollpacker.launcher``, the module behind the ``rollpacker-train``
command (tests/integration/test_package.py runs the installed command itself).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from testkit import REPO_ROOT, kill_group

CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"
FIRST_LINE_BOUND_S = 10.0
STEP_FIELDS = ("s, ETA ", " tok/s | reward ", " | len ", " loss ", " kl ", " gnorm ", " | queue ")


class Launch:
    """``rollpacker-train`` in a session of its own, its console (stderr and stdout) read line by line
    with the seconds since launch of each line."""

    def __init__(self, args: list[str], *, cwd: Path = REPO_ROOT):
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "rollpacker.launcher", *args], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**_env(), "PYTHONPATH": str(REPO_ROOT)})
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append((time.monotonic() - self.started, line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 600) -> None:
        """Until a line matches ``pattern`` (fails if the process ends first)."""
        with self._changed:
            ok = self._changed.wait_for(lambda: any(re.search(pattern, ln) for _, ln in self.lines)
                                        or self.proc.poll() is not None, timeout)
        assert ok and any(re.search(pattern, ln) for _, ln in self.lines), f"no line /{pattern}/:\n{self.text}"

    def finish(self, timeout: float = 900) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            kill_group(self.proc.pid)
        self._reader.join(30)
        print(self.text)
        return code

    @property
    def text(self) -> str:
        return "\n".join(f"{t:7.1f}s {ln}" for t, ln in self.lines)

    @property
    def console(self) -> str:
        return "\n".join(ln for _, ln in self.lines)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> tuple[Launch, Path]:
    out = tmp_path_factory.mktemp("console")
    launch = Launch(["--nproc-per-node", "2", "--config", str(CONFIG), "run.steps=2", f"run.output_dir={out}",
                     "run.eval.every=2", "run.eval.max_prompts=8"])
    assert launch.finish() == 0
    return launch, out / "tiny-cpu"


def test_first_line_within_bound_then_step_lines_with_every_field(two_steps):
    launch, _ = two_steps
    first_at, first = launch.lines[0]
    print(f"first line after {first_at:.2f}s: {first}")
    assert first_at < FIRST_LINE_BOUND_S and first.startswith("rollpacker: ") and "checking the config" in first
    steps = [ln for _, ln in launch.lines if re.search(r"rollpacker INFO step \d+/2 ", ln)]
    assert len(steps) == 2, launch.text
    for line in steps:
        assert all(field in line for field in STEP_FIELDS), line
        loss = re.search(r" loss (\S+) ", line).group(1)
        assert loss != "-0.0000" and float(loss) == float(loss), line  # digits enough to see it move
    assert re.search(r"eval of step 0: greedy pass@1 \d\.\d{3}, t1 pass@1 \d\.\d{3} pass@4 \d\.\d{3}", launch.console)


def test_one_summary_line_of_missing_kernels_instead_of_megatron_warnings(two_steps):
    launch, _ = two_steps
    assert "Transformer Engine and Apex not installed: megatron-core uses its plain-PyTorch" in launch.console
    assert "UserWarning" not in launch.console and "Traceback" not in launch.console
    assert "OMP_NUM_THREADS" not in launch.console and "wandb:" not in launch.console


def test_summary_and_resolved_config_in_the_run_directory(two_steps):
    launch, run_dir = two_steps
    summary = launch.console[launch.console.index("rollpacker: tiny-cpu: steps 1-2 of 2 in "):]
    assert re.search(r"eval greedy pass@1: \d\.\d{3} \(step 0\) -> \d\.\d{3} \(step 2\), best", summary)
    assert f"run directory {run_dir}: metrics.jsonl, config.yaml" in summary
    assert "checkpoints/step_00000002" in summary and "wandb sync " in summary
    saved = (run_dir / "config.yaml").read_text()
    assert "steps: 2" in saved and f"output_dir: {run_dir.parent}" in saved and str(REPO_ROOT / "assets") in saved


def test_rerun_of_a_finished_run_says_so_and_starts_nothing(two_steps):
    _, run_dir = two_steps
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    metrics = (run_dir / "metrics.jsonl").read_text()
    rerun = Launch(["--nproc-per-node", "2", "--config", str(CONFIG), "run.steps=2",
                    f"run.output_dir={run_dir.parent}"])
    assert rerun.finish(120) == 0
    assert rerun.lines[-1][1] == (f"rollpacker: {run_dir} is complete: its checkpoint of step 2 covers "
                                  "run.steps=2; nothing to do (raise run.steps to train on)")
    assert len(rerun.lines) == 2 and "started" not in rerun.console
    assert sorted((run_dir / "wandb").glob("offline-run-*")) == wandb_runs
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_ctrl_c_finishes_and_checkpoints_the_step_then_says_where_the_next_run_starts(tmp_path):
    launch = Launch(["--nproc-per-node", "2", "--config", str(CONFIG), "run.steps=20", f"run.output_dir={tmp_path}",
                     "data.eval_files=[]", "run.save_every=0"])
    launch.wait_for(r"INFO step 2/20 ")
    launch.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the foreground process
    assert launch.finish(120) == 128 + signal.SIGINT
    last = max(json.loads(ln)["step"] for ln in (tmp_path / "tiny-cpu" / "metrics.jsonl").read_text().splitlines())
    assert (tmp_path / "tiny-cpu" / "checkpoints" / f"step_{last:08d}" / "COMPLETE").exists()
    assert launch.lines[-1][1] == (f"rollpacker: interrupted after step {last}, which is checkpointed; the next "
                                   f"run resumes from step {last + 1}")
    assert "SIGINT received: finishing this step" in launch.console
    assert "Traceback" not in launch.console and "KeyboardInterrupt" not in launch.console
    assert not re.search(r"^[WE]\d{4} ", launch.console, re.M)  # torchrun's own log lines


# --- refusals: one message from the launcher, no rank started, no traceback ----------------------------
def _refused(args: list[str], tmp_path: Path, *, logged: bool = True) -> str:
    launch = Launch(["--nproc-per-node", "2", "--config", str(CONFIG), f"run.output_dir={tmp_path}", *args])
    assert launch.finish(120) == 2
    refusals = [ln for _, ln in launch.lines if ln.startswith("rollpacker: cannot start: ")]
    assert len(refusals) == 1 and "Traceback" not in launch.console and "ChildFailedError" not in launch.console
    assert "rank(s) started" not in launch.console  # refused before any rank
    if logged:  # the whole story, once the config names the run directory
        assert (tmp_path / "tiny-cpu" / "logs" / "refused.log").read_text().startswith("Traceback")
    return refusals[0]


def test_refuses_sglang_when_it_is_not_installed_naming_the_install_line_and_the_alternative(tmp_path):
    import importlib.util

    assert importlib.util.find_spec("sglang") is None, "this test needs a Python without sglang (requirements.txt)"
    line = _refused(["rollout.backend=sglang"], tmp_path)
    assert "rollout.backend=sglang, but SGLang is not installed" in line
    assert "pip install -r requirements-gpu.txt" in line and "rollout.backend=reference" in line


def test_refuses_a_dtype_the_cpu_trainer_cannot_run(tmp_path):
    line = _refused(["trainer.params_dtype=bf16"], tmp_path)
    assert "trainer.params_dtype=bf16" in line and "set trainer.params_dtype=fp32" in line


def test_refuses_a_data_source_without_a_scorer(tmp_path):
    rows = (REPO_ROOT / "assets" / "data" / "train.jsonl").read_text().splitlines()[:5]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows[:3] + [r.replace('"stepchain"', '"poetry"') for r in rows[3:]]) + "\n")
    line = _refused([f"data.train_files=[{data}]"], tmp_path)
    assert "data.train_files: 2 of 5 prompts: no scorer for data_source 'poetry'" in line


def test_refuses_a_broken_config_in_one_line(tmp_path):
    line = _refused(["trainer.lr=fast"], tmp_path, logged=False)
    assert "trainer.lr" in line


def test_convert_with_tp_but_one_rank_names_the_torchrun_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.convert", "hf-to-mcore", str(REPO_ROOT / "assets" /
                           "policy"), str(tmp_path / "out"), "--tp", "2"], capture_output=True, text=True,
                          env={**_env(), "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    print(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    assert proc.stderr.strip() == (f"rollpacker-convert: --tp 2 --pp 1 needs 2 rank(s), this run has 1: run it as "
                                   f"torchrun --nproc_per_node 2 -m megatron_ext.convert hf-to-mcore "
                                   f"{REPO_ROOT / 'assets' / 'policy'} {tmp_path / 'out'} --tp 2")
