"""``pip install .`` into a fresh virtual environment, then every ``rollpacker-*`` command from a
directory outside the repository: its help (quick: no torch, transformers or Megatron import before
the arguments are parsed, defaults shown) and a real run of each.

The environment sees this machine's packages (``--system-site-packages``) so that nothing is
downloaded: what is tested is this project's packaging and commands, not pip's resolver. The
sources are copied first: a build writes ``build/`` and ``*.egg-info`` beside them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit import REPO_ROOT, run_in_session

COMMANDS = ("train", "generate", "reward", "sim", "plan", "convert", "prepare")
HEAVY = ("torch", "transformers", "megatron")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("package")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    for package in ("rollpacker", "megatron_ext"):
        shutil.copytree(REPO_ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    env = root / "venv"
    # --without-pip: the machine's pip and setuptools (those of the environment's own ensurepip are
    # older than pyproject builds need), found through the system site-packages
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env)], check=True)
    started = time.monotonic()
    proc = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "--no-build-isolation",
                           "--no-index", str(src)], capture_output=True, text=True, cwd=root, env=_env())
    print(f"pip install . in {time.monotonic() - started:.1f}s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return env


def _env() -> dict[str, str]:
    drop = ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(venv: Path, command: str, args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = run_in_session([str(venv / "bin" / f"rollpacker-{command}"), *args], timeout=timeout, cwd=cwd,
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    print(f"$ rollpacker-{command} {' '.join(args)}  -> {proc.returncode}\n{proc.stdout[-1500:]}{proc.stderr[-3000:]}")
    return proc


@pytest.mark.parametrize("command", COMMANDS)
def test_help_answers_before_any_heavy_import_and_shows_defaults(venv, tmp_path, command):
    """The installed entry point, run in-process up to its --help exit: which modules it imported."""
    probe = ("import sys\nfrom importlib.metadata import entry_points\n"
             f"main = entry_points(group='console_scripts')['rollpacker-{command}'].load()\n"
             f"sys.argv = ['rollpacker-{command}', '--help']\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
             f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    started = time.monotonic()
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(), timeout=120)
    print(f"rollpacker-{command} --help: {time.monotonic() - started:.2f}s")
    assert proc.returncode == 0, proc.stderr
    assert f"usage: rollpacker-{command}" in proc.stdout
    assert proc.stdout.strip().endswith("HEAVY []"), proc.stdout[-500:]
    if command not in ("reward", "prepare"):  # theirs are required or unset (reward's subcommand shows its own)
        assert "(default: " in proc.stdout


def test_every_command_runs_from_another_directory(venv, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    policy, config = REPO_ROOT / "assets" / "policy", REPO_ROOT / "configs" / "tiny-cpu.yaml"

    raw = work / "gsm8k.jsonl"
    raw.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"})
                           + "\n" for i in range(3)))
    assert _run(venv, "prepare", ["--source", "gsm8k", "--input", "gsm8k.jsonl", "--output", "rows.jsonl"],
                work).returncode == 0
    rows = [json.loads(line) for line in (work / "rows.jsonl").read_text().splitlines()]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1", "2", "3"]

    (work / "responses.jsonl").write_text(
        json.dumps({"data_source": "gsm8k", "response": "so \\boxed{2}", "ground_truth": "2"}) + "\n"
        + json.dumps({"data_source": "gsm8k", "response": "\\boxed{5}", "ground_truth": "2"}) + "\n")
    scored = _run(venv, "reward", ["score", "responses.jsonl", "-o", "scores.jsonl"], work)
    assert scored.returncode == 0
    assert [json.loads(line)["correct"] for line in (work / "scores.jsonl").read_text().splitlines()] == [True, False]

    (work / "prompts.jsonl").write_text(json.dumps({"prompt": "Start at 3, apply +2 2 times mod 10."}) + "\n")
    generated = _run(venv, "generate", ["--model", str(policy), "--input", "prompts.jsonl", "--output", "out.jsonl",
                                        "--n", "2", "--max-new-tokens", "8"], work)
    assert generated.returncode == 0 and len((work / "out.jsonl").read_text().splitlines()) == 2

    sim = _run(venv, "sim", ["--rounds", "2", "--json"], work)
    assert sim.returncode == 0 and json.loads(sim.stdout)["summary"]["speedup"] > 1

    plan = _run(venv, "plan", ["--config", str(REPO_ROOT / "configs" / "qwen2.5-7b.yaml")], work)
    assert plan.returncode == 0 and "rollout" in plan.stdout

    verify = _run(venv, "convert", ["--verify", str(policy)], work)
    assert verify.returncode == 0 and verify.stdout.rstrip().endswith("PASS")

    train = _run(venv, "train", ["--nproc-per-node", "2", "--config", str(config), "run.steps=1",
                                 f"model.path={policy}", f"data.train_files=[{REPO_ROOT / 'assets/data/train.jsonl'}]",
                                 "data.eval_files=[]", "run.output_dir=runs"], work, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    assert (work / "runs" / "tiny-cpu" / "checkpoints" / "step_00000001" / "COMPLETE").exists()
    assert "rollpacker: tiny-cpu: steps 1-1 of 1 in " in train.stderr
