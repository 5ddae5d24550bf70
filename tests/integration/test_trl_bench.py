"""bench/e2e/trl_grpo.py, the TRL GRPOTrainer peer: its CLI contract and one tiny training step.

The training test needs TRL (``pip install -r requirements-bench.txt``), which CI does not
install; it is skipped there. The CLI tests run everywhere.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "e2e" / "trl_grpo.py"


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_help_works_without_trl_and_names_the_install_command():
    out = _run([str(SCRIPT), "--help"], timeout=30)
    assert out.returncode == 0, out.stderr
    assert "pip install -r requirements-bench.txt" in " ".join(out.stdout.split())


def test_missing_trl_is_a_clear_error():
    # Hide trl even where it is installed: the runner must say how to get it, not raise ImportError.
    code = ("import sys; sys.modules['trl'] = None; sys.path.insert(0, 'bench/e2e'); import trl_grpo; "
            "trl_grpo.main(['--steps', '1', '--p0', '2', '--r0', '2'])")
    out = _run(["-c", code], timeout=60)
    assert out.returncode != 0
    assert "pip install -r requirements-bench.txt" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="trl not installed (pip install -r requirements-bench.txt)")
@pytest.mark.timeout(120)
def test_one_step_writes_the_json_contract(tmp_path):
    out_json = tmp_path / "trl.json"
    out = _run([str(SCRIPT), "--policy", "assets/policy", "--data", "assets/data/train.jsonl",
                "--steps", "1", "--p0", "2", "--r0", "2", "--max-response-length", "16", "--lr", "2e-4",
                "--seed", "0", "--threads", "1", "--temperature", "1.0", "--json", str(out_json)], timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_json.read_text())
    assert result["trl_version"].startswith("1.16")
    assert (result["steps"], result["p0"], result["r0"]) == (1, 2, 2)
    for key in ("seconds_per_step", "generation_seconds", "reward_mean", "accuracy", "prompts_trained"):
        assert len(result[key]) == 1, key
    assert result["seconds_per_step"][0] > result["generation_seconds"][0] > 0
    assert 0.0 <= result["reward_mean"][0] <= 1.0 and 0.0 <= result["accuracy"][0] <= 1.0
    assert result["prompts_trained"] == [2]
    settings = result["settings"]
    assert settings["beta"] == 0.0 and settings["loss_type"] == "dapo" and settings["use_cpu"] is True
    assert settings["per_device_train_batch_size"] == 4 and settings["num_generations"] == 2
    assert settings["max_completion_length"] == 16 and settings["gradient_checkpointing"] is False
    assert "seconds/step" in out.stdout
