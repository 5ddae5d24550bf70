"""The real ``sglang.Engine`` (0.5.23) on CPU, against transformers and against our backend.

The engine runs in a cached venv built by ``sglang_cpu.env`` (first build: about 1.5 minutes). It is
never skipped: if the venv cannot be built, the test fails with pip's reason.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.sglang_cpu.env import REPO, engine_env, sglang_python

CHECKS = Path(__file__).resolve().parent / "sglang_cpu" / "engine_checks.py"
POLICY = REPO / "assets" / "policy"
TIMEOUT_S = 300


@pytest.fixture(scope="session")
def sglang_venv_python() -> Path:
    return sglang_python()


def run_in_venv(cmd: list[str], what: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` with the engine's environment; a run past ``timeout`` fails the test with its output."""
    try:
        return subprocess.run(cmd, env=engine_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} ran past {timeout}s:\n{(exc.output or '')[-6000:]}")

def run_checks(python: Path, mode: str, torchrun: bool = False) -> dict:
    # As launch/train.sh starts the trainer: a torchrun worker of a c10d rendezvous (review C2).
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] if torchrun else []
    proc = run_in_venv([str(python), *launcher, str(CHECKS), mode, str(POLICY)], f"engine_checks.py {mode}", TIMEOUT_S)
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("VERDICT ")]
    assert verdicts, f"engine_checks.py {mode} printed no verdict (exit {proc.returncode}):\n{proc.stdout[-6000:]}"
    verdict = json.loads(verdicts[-1].removeprefix("VERDICT "))
    assert "crashed" not in verdict, f"engine_checks.py {mode} crashed:\n{verdict['crashed']}\n" \
                                     f"--- output ---\n{proc.stdout[-4000:]}"
    return verdict


def assert_all_true(verdict: dict) -> None:
    failed = {k: v for k, v in verdict.items() if k != "seconds" and v is not True}
    assert not failed, json.dumps(failed, indent=1)


def test_real_engine_greedy_and_weight_update_session(sglang_venv_python):
    """Greedy equals transformers; an update outside begin/end_weight_update is refused (review C1);
    inside the session it lands and greedy equals transformers with the new weights."""
    verdict = run_checks(sglang_venv_python, "engine")
    assert_all_true(verdict)
    assert set(verdict) >= {"greedy_matches_transformers", "update_outside_session_refused",
                            "update_in_session_succeeds", "greedy_after_update_matches_transformers"}


def test_backend_on_real_engine_under_torchrun(sglang_venv_python):
    """Our ``SGLangEngine`` on the real engine, in a torchrun worker of a c10d rendezvous:
    - the engine starts there (review C2: it hung waiting for a TCPStore nobody served);
    - ``update_weights``: generation afterwards equals transformers loaded with the pushed weights
      (C1: refused outside the session), and a refusal raises;
    - ``stats()`` reports the engine's KV capacity (32768 here) and its load (L6: capacity was 0);
    - ``abort_all()`` then at once ``release_memory``/``resume_memory``: the release waits until sglang
      holds none of the aborted requests (L1: sglang's scheduler asserted an idle engine and
      SIGQUIT the process), and greedy output afterwards still equals transformers."""
    verdict = run_checks(sglang_venv_python, "backend", torchrun=True)
    assert_all_true(verdict)
    assert set(verdict) >= {"under_torchrun_agent_store", "engine_starts_under_torchrun", "worker_env_restored",
                            "backend_greedy_matches_transformers", "backend_update_weights_returns",
                            "backend_greedy_after_update_matches_transformers",
                            "backend_raises_when_sglang_refuses", "stats_kv_capacity_is_the_engines",
                            "stats_report_engine_load", "release_after_abort_waits_for_idle",
                            "aborted_requests_never_surface", "greedy_after_release_resume_matches_transformers"}


GEN_PROMPTS = ({"prompt": "The capital of France is"}, {"prompt": "1 + 1 ="}, {"input_ids": [20, 21, 22, 40]})
GEN_TOKENS = 16


def transformers_greedy(rows, new_tokens: int) -> list[list[int]]:
    """Greedy reference in this process: argmax of the full-sequence forward, no EOS stop."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(POLICY)
    model = Qwen2ForCausalLM.from_pretrained(POLICY, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for row in rows:
            ids = tok(row["prompt"])["input_ids"] if "prompt" in row else list(row["input_ids"])
            seq = list(ids)
            for _ in range(new_tokens):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(ids):])
    return outs


def free_base_port(tp: int, local_ranks: int = 1) -> int:
    """An ``sglang_base_port`` the config accepts whose TP-``tp`` engine ports of local ranks
    ``0..local_ranks-1`` are free (concurrent runs on one machine must not collide on the default)."""
    import socket

    from rollpacker.configlib import ConfigError
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.sglang_args import engine_ports

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            RolloutConfig(backend="sglang", sglang_base_port=base).validate()
            for port in [p for rank in range(local_ranks) for p in engine_ports(base, rank, tp)]:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except (ConfigError, OSError):
            continue
        return base
    raise RuntimeError("no free sglang base port")


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_cli_on_real_engine_equals_transformers_greedy(sglang_venv_python, tmp_path, tp):
    """``python -m rollpacker.generate --backend sglang`` on CPU (the backend's own CPU server args):
    greedy output equals transformers token for token, and the process exits by itself. TP 2 runs
    under torchrun as one TP-2 sglang engine led by rank 0; the backend splits the CPUs between its
    two TP ranks (without that sglang 0.5.23 asserts one NUMA node per rank)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GEN_PROMPTS))
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp)] if tp > 1 else []
    cmd = [str(sglang_venv_python), *launcher, "-m", "rollpacker.generate", "--backend", "sglang", "--tp", str(tp),
           "--model", str(POLICY), "--input", str(src), "--output", str(out), "--temperature", "0",
           "--max-new-tokens", str(GEN_TOKENS), "--ignore-eos", "--sglang-base-port", str(free_base_port(tp))]
    proc = run_in_venv(cmd, f"rollpacker.generate --tp {tp}", TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert f"(sglang, tp={tp}" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, 0) for i in range(len(GEN_PROMPTS))]
    assert [r["output_ids"] for r in rows] == transformers_greedy(GEN_PROMPTS, GEN_TOKENS)
    assert all(len(r["logprobs"]) == GEN_TOKENS and all(lp <= 0 for lp in r["logprobs"]) for r in rows)


PROGRAM_STEPS = 3
PROGRAM_TIMEOUT_S = 600


def test_training_program_on_real_engine(sglang_venv_python, tmp_path):
    """The whole program on SGLang: ``torchrun --nproc_per_node 2 -m rollpacker.train`` on the tiny CPU
    config with ``rollout.backend=sglang``, planner off (one TP-1 engine per rank: sglang keeps one
    live engine per process). Three steps complete with their metrics; the rollout ran on sglang's CPU
    engine, and the trainer's log-probs of what it generated agree with the engine's (so the weight
    sync of every step reached the engine: stale weights would show here after step 1)."""
    out = tmp_path / "run"
    cmd = [str(sglang_venv_python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "rollpacker.train", "--config", "configs/tiny-cpu.yaml", "rollout.backend=sglang",
           f"rollout.sglang_base_port={free_base_port(1, local_ranks=2)}", "scheduler.planner.enabled=false",
           f"run.steps={PROGRAM_STEPS}", "run.wandb=disabled", f"run.output_dir={out}"]
    proc = run_in_venv(cmd, "rollpacker.train on sglang", PROGRAM_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "server_args={" in proc.stdout and "'device': 'cpu'" in proc.stdout, "no sglang engine was started"
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, PROGRAM_STEPS + 1))
    for m in metrics:
        assert m["generated_tokens"] > 0 and m["train/sequences"] > 0 and m["sync/bytes"] > 0
        assert m["train/logprob_mismatch"] < 1e-4, m
    assert (run_dir / "checkpoints" / f"step_{PROGRAM_STEPS:08d}" / "COMPLETE").exists()
