"""The shipped starting policy still has the properties the benchmarks rely on.

Recomputed from the files in ``assets/`` (transformers sampling, temperature
1.0, 4 responses per held-out prompt; docs/example.md's figures, taken with 8,
are the same): GRPO signal, a long tail, and lengths that are a property of
the prompt. That sampling (about a minute on 2 cores, more when they are shared) is in
tests/integration/test_policy_quality_slow.py; here, what is quick: the shipped files, the report's
arithmetic, the warm-up's determinism and its rejected answer lines.
"""
from __future__ import annotations

import json
import math
import statistics

import pytest

from rollpacker.examples.policy_report import report_from_lengths
from rollpacker.stats import spearman
from rollpacker.examples.task import MAX_STEPS, MEDIAN_STEPS, RECHECK_MEDIAN_STEPS, TASK_NAME
from testkit import REPO_ROOT

POLICY = REPO_ROOT / "assets" / "policy"
EVAL = REPO_ROOT / "assets" / "data" / "eval.jsonl"
TRAIN = REPO_ROOT / "assets" / "data" / "train.jsonl"


def test_spearman_against_known_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486833)  # ties share a rank


def test_report_from_lengths():
    report = report_from_lengths([[10, 10, 12, 12], [100, 300, 200, 200]],
                                 [[True, False, True, False], [False] * 4])
    assert report.pass_at_1 == 0.25
    assert report.median_length == 56 and report.max_length == 300
    assert report.length_spearman == pytest.approx(1.0)
    assert report.step_max_over_median == pytest.approx(300 / 56)  # both prompts in one step of 16
    log_sd = [0.5 * math.log(1.2), statistics.pstdev([math.log(x) for x in (100, 300, 200, 200)])]
    assert report.within_prompt_log_sd == pytest.approx(statistics.fmean(log_sd))


@pytest.mark.parametrize("policy,data,median_steps", [
    (POLICY, TRAIN.parent, MEDIAN_STEPS),
    (REPO_ROOT / "assets" / "policy-recheck", REPO_ROOT / "assets" / "data-recheck", RECHECK_MEDIAN_STEPS),
])
def test_shipped_files_are_complete_and_small(policy, data, median_steps):
    names = {p.name for p in policy.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in policy.iterdir()) < 20 * 2**20
    config = json.loads((policy / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["num_attention_heads"] % 2 == 0 and config["num_key_value_heads"] % 2 == 0  # TP=2
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    evaluation = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(evaluation)) == (2048, 256)
    assert {row["data_source"] for row in train + evaluation} == {TASK_NAME}
    assert max(row["extra_info"]["num_steps"] for row in evaluation) <= MAX_STEPS
    assert statistics.median(row["extra_info"]["num_steps"] for row in train) == median_steps


def test_warmup_is_deterministic_from_its_seed(tmp_path):
    from safetensors.torch import load_file

    from rollpacker.examples.make_policy import WarmupConfig, train

    def weights(seed: int, name: str):
        cfg = WarmupConfig(seed=seed, hidden_size=32, intermediate_size=64, num_layers=2, steps=3,
                           batch_tokens=1024, warmup_steps=1)
        train(cfg, tmp_path / name)
        return load_file(tmp_path / name / "model.safetensors")

    first, again, other = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert all(first[k].equal(again[k]) for k in first)
    assert not all(first[k].equal(other[k]) for k in first)


def test_rejected_answer_lines_come_at_their_rate_and_the_checker_rejects_them():
    import random

    from rollpacker.examples import task
    from rollpacker.examples.make_policy import REJECTED_ANSWER_LINES, WarmupConfig, _response

    rng = random.Random(0)
    cfg = WarmupConfig(step_error_rate=0.0, rejected_format_rate=0.55)
    problems = [task.sample_problem(rng) for _ in range(2000)]
    reasons = [task.score_response(_response(p, rng, cfg), str(p.answer()))[1] for p in problems]
    share = reasons.count("no_answer") / len(reasons)
    print(f"rejected answer lines: {share:.3f} of {len(reasons)} demonstrations")
    assert 0.52 < share < 0.58 and set(reasons) == {"ok", "no_answer"}  # the chain itself stays right
    last_lines = {_response(p, rng, cfg).splitlines()[-1].split(str(p.answer()))[0] for p in problems[:300]}
    assert last_lines == {"Answer: ", *(line.format("") for line in REJECTED_ANSWER_LINES)}
    assert all(task.score_response(_response(p, rng, WarmupConfig(step_error_rate=0.0)), str(p.answer()))[0]
               for p in problems[:200])
