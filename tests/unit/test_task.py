"""The stepchain task: generator, derivations, strict scoring, tokenizer."""
from __future__ import annotations

import random
import statistics

import pytest

from rollpacker.examples import task
from rollpacker.examples.tokenizer import build_tokenizer, save_tokenizer, user_prompt
from testkit import make_random_qwen2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """Loaded next to a qwen2 config.json, as the shipped policy is: transformers then builds Qwen2Tokenizer."""
    from transformers import AutoTokenizer

    path = make_random_qwen2(tmp_path_factory.mktemp("policy"), vocab_size=len(build_tokenizer().get_vocab()))
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_rows_follow_the_verl_schema_and_are_reproducible():
    rows = task.generate_rows(50, seed=11)
    assert rows == task.generate_rows(50, seed=11)
    assert rows != task.generate_rows(50, seed=12)
    row = rows[0]
    assert row["data_source"] == task.TASK_NAME == "stepchain"
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("Start at ")
    assert row["reward_model"]["style"] == "rule" and isinstance(row["reward_model"]["ground_truth"], str)
    assert 1 <= row["extra_info"]["num_steps"] <= task.MAX_STEPS


def test_derivation_of_a_known_chain():
    problem = task.Problem(start=7, operation="+3", num_steps=4)
    assert problem.prompt_text() == "Start at 7, apply +3 4 times mod 10."
    assert task.derivation(problem) == "4:7+3=0\n3:0+3=3\n2:3+3=6\n1:6+3=9\nAnswer: 9"
    assert task.score_response(task.derivation(problem), "9") == (True, "ok")
    assert task.apply_operation(3, "-5") == 8 and task.apply_operation(7, "*6") == 2


def test_rechecks_derive_again_after_the_prompt_line_and_answer_from_the_last_derivation():
    problem = task.Problem(start=7, operation="+3", num_steps=2)
    chain = "2:7+3=0\n1:0+3=3"

    class Draws(random.Random):  # recheck after the first and the second derivation, then answer
        def __init__(self):
            super().__init__(0)
            self.values = iter([0.1, 0.5, 0.99])

        def random(self):
            return next(self.values)

    text = task.derivation(problem, rng=Draws(), rechecks=task.Rechecks(first=0.2, again=0.6))
    assert text == f"{chain}\n{problem.prompt_text()}\n{chain}\n{problem.prompt_text()}\n{chain}\nAnswer: 3"
    assert task.score_response(text, "3") == (True, "ok")
    # a wrong first derivation and a right recheck: the answer is the recheck's
    wrong = text.replace("1:0+3=3\nStart", "1:0+3=4\nStart", 1)
    assert task.score_response(wrong, "3") == (True, "ok")


def test_recheck_counts_follow_their_rates_and_the_default_draws_nothing():
    rng = random.Random(0)
    counts = [task.RECHECKS.draw(rng) for _ in range(20000)]
    first, again = task.RECHECKS.first, task.RECHECKS.again
    print(f"derivations per response: 1 in {counts.count(1) / len(counts):.3f}, mean {statistics.fmean(counts):.2f}")
    assert counts.count(1) / len(counts) == pytest.approx(1 - first, abs=0.01)
    assert statistics.fmean(counts) == pytest.approx(1 + first / (1 - again), rel=0.05)
    rng, untouched = random.Random(1), random.Random(1)
    assert task.Rechecks().draw(rng) == 1 and rng.random() == untouched.random()  # the shipped recipe's stream


def test_step_counts_are_heavy_tailed():
    steps = [row["extra_info"]["num_steps"] for row in task.generate_rows(4000, seed=0)]
    median = statistics.median(steps)
    assert median == 3
    assert max(steps) == task.MAX_STEPS
    assert sum(s >= 10 * median for s in steps) / len(steps) > 0.02  # a real tail, not a few outliers
    assert sum(s <= 2 * median for s in steps) / len(steps) > 0.6


@pytest.mark.parametrize("response, reason", [
    ("1:6+3=9\nAnswer: 9", "ok"),
    ("Answer: 9\n", "ok"),
    ("1:6+3=8\nAnswer: 8", "wrong_answer"),
    ("Answer: 09", "wrong_answer"),
    ("1:6+3=9", "no_answer"),
    ("", "no_answer"),
    ("Answer: 9\n1:9+1=0", "no_answer"),  # an answer that is not the last line does not count
    ("Answer:9", "no_answer"),
    ("The answer is 9", "no_answer"),
    ("Answer: 9 or 8", "no_answer"),
])
def test_scoring_is_strict(response, reason):
    assert task.score_response(response, "9") == (reason == "ok", reason)


def test_noisy_derivations_keep_the_chain_consistent():
    problem = task.sample_problem(random.Random(1), num_steps=40)
    noisy = task.derivation(problem, rng=random.Random(0), error_rate=0.5)
    lines = noisy.splitlines()
    assert len(lines) == 41 and noisy != task.derivation(problem)
    previous = str(problem.start)
    for remaining, line in zip(range(40, 0, -1), lines):  # each step starts from the value written above
        assert line.startswith(f"{remaining}:{previous}{problem.operation}=")
        previous = line.split("=")[1]
    assert lines[-1] == f"Answer: {previous}"


def test_tokenizer_round_trip_and_fixed_costs(tokenizer):
    problem = task.sample_problem(random.Random(3), num_steps=task.MAX_STEPS)
    response = task.derivation(problem)
    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert ids == build_tokenizer().encode(response).ids  # what the warm-up trained on
    assert tokenizer.decode(ids) == response
    # one token a digit and a symbol: "12:7+3=0\n" is 9; the answer line 4
    assert len(ids) == sum(len(str(r)) + 7 for r in range(1, task.MAX_STEPS + 1)) + 4
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt_text()}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == user_prompt(problem.prompt_text())  # what the warm-up trains on
    assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) <= 128  # data.max_prompt_length
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
