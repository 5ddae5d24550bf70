"""The memory plan's command line (``python -m rollpacker.plan``), run as a process: the printed plan of
the shipped configs and a refusal. Its arithmetic: tests/unit/test_plan.py."""
from __future__ import annotations

import subprocess
import sys

from testkit import REPO_ROOT


def test_cli_prints_the_plan():
    out = subprocess.run([sys.executable, "-m", "rollpacker.plan", "--config", "configs/qwen2.5-32b.yaml"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "memory plan: configs/qwen2.5-32b.yaml"
    assert "64 GPUs of 80.00 GB" in out.stdout  # the published 8 nodes x 8
    for row in ("trainer params (bf16)", "trainer grads (fp32 buffer)", "log-prob buffers", "engine KV pool (TP 4)",
                "total", "left"):
        assert any(line.startswith(row) for line in lines), row
    assert lines[-1] == "fits"
    qwen3 = subprocess.run([sys.executable, "-m", "rollpacker.plan", "--config", "configs/qwen3-8b.yaml"],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert qwen3.returncode == 0, qwen3.stderr
    assert "8 GPUs of 80.00 GB" in qwen3.stdout and "heads 32/8 kv" in qwen3.stdout  # the planner experiment's node
    assert qwen3.stdout.splitlines()[-1] == "fits"
    refused = subprocess.run([sys.executable, "-m", "rollpacker.plan", "--config", "configs/qwen2.5-32b.yaml",
                              "scheduler.planner.min_tp=1"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 1 and "DOES NOT FIT: rollout engine TP 1" in refused.stdout
