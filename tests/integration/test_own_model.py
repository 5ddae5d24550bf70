"""docs/own-model.md, walked through on a CPU: a random Qwen2 checkpoint with a tokenizer of its own
(not the shipped policy's), GSM8K-style raw data, the config made as the page says (copy
configs/qwen2.5-7b.yaml, edit the listed keys), then each command of the page in order.

Every command is the installed one a user types (``rollpacker-*``, from ``pip install -r
requirements.txt``), run from a directory outside the repository.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from testkit import REPO_ROOT, make_random_qwen2, run_in_session

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _command(name: str) -> str:
    path = shutil.which(f"rollpacker-{name}")
    assert path, f"rollpacker-{name} is not installed: pip install -r requirements.txt installs this repository"
    return path


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    proc = run_in_session(cmd, timeout=timeout, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    print(f"$ {' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))} -> {proc.returncode}\n"
          f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return proc


def _own_tokenizer(out: Path, corpus: list[str]) -> int:
    """A byte-level BPE trained on ``corpus``, with a chat template; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)
    return len(fast)


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """The user's directory: a model, raw data and nothing else."""
    home = tmp_path_factory.mktemp("user")
    questions = [f"Tom has {a} apples and buys {b} more. How many apples does he have?" for a in range(1, 9)
                 for b in range(1, 5)]
    raw = [{"question": q, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
           for q, (a, b) in zip(questions, [(a, b) for a in range(1, 9) for b in range(1, 5)])]
    (home / "raw").mkdir()
    (home / "raw" / "gsm8k_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    model = home / "models" / "my-qwen"
    vocab = _own_tokenizer(model, questions + [r["answer"] for r in raw])
    make_random_qwen2(model, seed=3, vocab_size=vocab, eos_token_id=0)
    return home


def test_own_model_walkthrough_on_cpu(user):
    model = user / "models" / "my-qwen"
    # 1. the model: Megatron reproduces transformers on it
    verify = _run([_command("convert"), "--verify", str(model)], user)
    assert verify.returncode == 0 and verify.stdout.rstrip().endswith("PASS")

    # 2. the data, and a few labels through the reward pool
    prepare = _run([_command("prepare"), "--source", "gsm8k", "--input", "raw/gsm8k_train.jsonl", "--output",
                    "data/gsm8k.jsonl", "--split-eval", "8"], user)
    assert prepare.returncode == 0
    rows = [json.loads(line) for line in (user / "data" / "gsm8k.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and rows[0]["data_source"] == "gsm8k"
    (user / "samples.jsonl").write_text(json.dumps({"data_source": "gsm8k", "response": "so \\boxed{3}",
                                                    "ground_truth": rows[1]["reward_model"]["ground_truth"]}) + "\n")
    assert _run([_command("reward"), "score", "samples.jsonl"], user).returncode == 0

    # 3. the config: copied from the 7B one, the listed keys edited
    (user / "configs").mkdir()
    cfg = yaml.safe_load((REPO_ROOT / "configs" / "qwen2.5-7b.yaml").read_text())
    cfg["run"].update(name="my-run", steps=2, save_every=1)
    cfg["run"]["eval"].update(every=2, samplings=[{"name": "greedy", "temperature": 0.0}])
    cfg["model"]["path"] = "models/my-qwen"
    cfg["data"].update(train_files=["data/gsm8k.jsonl"], eval_files=["data/gsm8k.eval.jsonl"], max_prompt_length=96)
    cfg["scheduler"].update(p0=4, r0=4)
    cfg["scheduler"]["planner"]["max_tp"] = 2
    cfg["rollout"]["max_response_length"] = 24
    cfg["reward"]["num_workers"] = 2
    cfg["trainer"].update(tp=1, micro_batch_tokens=2048)
    (user / "configs" / "my-run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    plan = _run([_command("plan"), "--config", "configs/my-run.yaml", "--nodes", "1", "--gpus-per-node", "2"], user)
    assert plan.returncode == 0 and plan.stdout.rstrip().endswith("fits")

    # 4. launch on this machine: the CPU keys the page names are refused, one at a time, until set
    train = [_command("train"), "--nproc-per-node", "2", "--config", "configs/my-run.yaml"]
    refused = _run(train, user)
    assert refused.returncode == 2 and "rollout.backend=sglang, but SGLang is not installed" in refused.stderr
    refused = _run([*train, "rollout.backend=reference"], user)
    assert refused.returncode == 2 and "set trainer.params_dtype=fp32" in refused.stderr
    for proc in (refused,):
        assert "Traceback" not in proc.stderr
    cpu = [*train, "rollout.backend=reference", "trainer.params_dtype=fp32"]
    run = _run(cpu, user, timeout=900)
    assert run.returncode == 0
    assert "rollpacker: my-run: steps 1-2 of 2 in " in run.stderr and "eval greedy pass@1: " in run.stderr

    # 5. watch: the run directory the page describes
    run_dir = user / "runs" / "my-run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward_mean" in m] == [1, 2]
    assert {m["step"] for m in metrics if "eval/greedy/pass@1" in m} == {0, 2}
    export = run_dir / "checkpoints" / "step_00000002" / "hf"
    assert (export / "model.safetensors").exists() and (export / "tokenizer.json").exists()
    assert json.loads((export / "tokenizer.json").read_text())["model"]["vocab"] == \
        json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]  # its own, carried through

    # 6. resume: the same command again has nothing left to do; raising run.steps trains on
    again = _run(cpu, user, timeout=120)
    assert again.returncode == 0 and again.stderr.rstrip().endswith("nothing to do (raise run.steps to train on)")
