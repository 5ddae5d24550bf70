"""The built-in verifiable task, "stepchain": a chain of modular arithmetic steps.

A prompt names a start value and a list of numbered operations, e.g.

    Start at 7, apply #1+3#2*2#3-5 mod 20.

and the correct response derives the value one operation per line, then gives a
strict final answer line:

    #1:7+3=10
    #2:10*2=0
    #3:0-5=15
    Answer: 15

Why this shape: tail batching only pays off when response lengths are
long-tailed *and* set by the prompt.  Here the response length is a fixed
function of the number of operations (7 tokens a step with the built-in
tokenizer), and that number is drawn from a clipped log-normal, so most prompts
take a few steps and a few take fifty.  Errors compound over steps, so long
prompts are also the hard ones, as in real reasoning traces.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

TASK_NAME = "stepchain"
MODULUS = 20
MAX_STEPS = 50
# Step counts are log-normal: median 3, sigma 1.2, clipped to 1..MAX_STEPS.  With
# 7 tokens a step, 256 prompts give a median response of ~26 tokens and a
# longest of ~300-350.
MEDIAN_STEPS = 3.0
SIGMA_STEPS = 1.2
OPERATIONS: tuple[str, ...] = tuple(f"{sym}{d}" for sym in "+-" for d in range(1, 10)) + tuple(
    f"*{d}" for d in range(2, 10)
)

_ANSWER_LINE = re.compile(r"Answer: (\d+)")


@dataclass(frozen=True)
class Problem:
    start: int
    operations: tuple[str, ...]

    @property
    def num_steps(self) -> int:
        return len(self.operations)

    def prompt_text(self) -> str:
        ops = "".join(f"#{i}{op}" for i, op in enumerate(self.operations, start=1))
        return f"Start at {self.start}, apply {ops} mod {MODULUS}."

    def values(self) -> list[int]:
        """The running value after each operation."""
        out, value = [], self.start
        for op in self.operations:
            value = apply_operation(value, op)
            out.append(value)
        return out

    def answer(self) -> int:
        return self.values()[-1]


def apply_operation(value: int, op: str) -> int:
    sym, operand = op[0], int(op[1:])
    if sym == "+":
        return (value + operand) % MODULUS
    if sym == "-":
        return (value - operand) % MODULUS
    return (value * operand) % MODULUS


def derivation(problem: Problem, *, rng: random.Random | None = None, error_rate: float = 0.0) -> str:
    """The step-by-step response for ``problem``.

    With ``error_rate`` > 0 each step's result is replaced, with that
    probability, by a wrong value, and the chain carries on from it: the
    imperfect demonstrations the warm-up policy learns from.
    """
    lines, value = [], problem.start
    for i, op in enumerate(problem.operations, start=1):
        result = apply_operation(value, op)
        if rng is not None and error_rate > 0 and rng.random() < error_rate:
            result = (result + rng.randrange(1, MODULUS)) % MODULUS
        lines.append(f"#{i}:{value}{op}={result}")
        value = result
    lines.append(f"Answer: {value}")
    return "\n".join(lines)


def sample_num_steps(rng: random.Random) -> int:
    steps = round(math.exp(rng.gauss(math.log(MEDIAN_STEPS), SIGMA_STEPS)))
    return min(max(steps, 1), MAX_STEPS)


def sample_problem(rng: random.Random, num_steps: int | None = None) -> Problem:
    n = sample_num_steps(rng) if num_steps is None else num_steps
    if not 1 <= n <= MAX_STEPS:
        raise ValueError(f"num_steps must be in 1..{MAX_STEPS}, got {n}")
    return Problem(start=rng.randrange(MODULUS), operations=tuple(rng.choice(OPERATIONS) for _ in range(n)))


def to_row(problem: Problem, index: int) -> dict:
    """One dataset row in the verl schema."""
    return {
        "data_source": TASK_NAME,
        "prompt": [{"role": "user", "content": problem.prompt_text()}],
        "reward_model": {"ground_truth": str(problem.answer()), "style": "rule"},
        "extra_info": {"index": index, "num_steps": problem.num_steps},
    }


def generate_rows(n: int, seed: int) -> list[dict]:
    """``n`` rows of the task, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [to_row(sample_problem(rng), i) for i in range(n)]


def extract_answer(response: str) -> str | None:
    """The value on the final line if that line is exactly ``Answer: N``, else None."""
    lines = response.strip().splitlines()
    if not lines:
        return None
    match = _ANSWER_LINE.fullmatch(lines[-1].strip())
    return match.group(1) if match else None


def score_response(response: str, ground_truth: str) -> tuple[bool, str]:
    """``(correct, reason)``; reason is "ok", "wrong_answer" or "no_answer".

    Strict: only the last line counts, and it must be exactly ``Answer: N``;
    an answer stated anywhere else is no answer.
    """
    answer = extract_answer(response)
    if answer is None:
        return False, "no_answer"
    if answer == str(ground_truth).strip():
        return True, "ok"
    return False, "wrong_answer"
