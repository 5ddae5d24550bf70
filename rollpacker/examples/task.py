"""The built-in verifiable task, "stepchain": a countdown of modular arithmetic steps.

A prompt names a start value, an operation and how many times to apply it:

    Start at 7, apply +3 4 times mod 10.

and the correct response derives the value one application per line, each line
tagged with the number of applications still to do, then gives a strict final
answer line:

    4:7+3=0
    3:0+3=3
    2:3+3=6
    1:6+3=9
    Answer: 9

Why this shape: tail batching only pays off when response lengths are
long-tailed *and* set by the prompt.  Here the response length is a fixed
function of the step count (8-9 tokens a step with the built-in Qwen2-style
tokenizer), and that count is drawn from a clipped log-normal, so most prompts
take a few steps and a few take fifty.  Errors compound over steps, so long
prompts are also the hard ones, as in real reasoning traces.  Every step only needs the line above
it and the operation (the countdown tag says when to stop), so a policy of a
few hundred thousand parameters learns it in minutes on a CPU.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

TASK_NAME = "stepchain"
MODULUS = 10
MAX_STEPS = 50
# Step counts are log-normal: median 3, sigma 1.2, clipped to 1..MAX_STEPS.  With
# 8-9 tokens a step, 256 prompts give a median response of ~29 tokens and a
# longest of ~350-445.
MEDIAN_STEPS = 3.0
SIGMA_STEPS = 1.2
OPERATIONS: tuple[str, ...] = tuple(f"{sym}{d}" for sym in "+-" for d in range(1, 10)) + tuple(
    f"*{d}" for d in range(2, 10)
)

_ANSWER_LINE = re.compile(r"Answer: (\d+)")


@dataclass(frozen=True)
class Problem:
    start: int
    operation: str
    num_steps: int

    def prompt_text(self) -> str:
        return f"Start at {self.start}, apply {self.operation} {self.num_steps} times mod {MODULUS}."

    def answer(self) -> int:
        value = self.start
        for _ in range(self.num_steps):
            value = apply_operation(value, self.operation)
        return value


def apply_operation(value: int, op: str) -> int:
    sym, operand = op[0], int(op[1:])
    if sym == "+":
        return (value + operand) % MODULUS
    if sym == "-":
        return (value - operand) % MODULUS
    return (value * operand) % MODULUS


@dataclass(frozen=True)
class Rechecks:
    """How often a response re-reads the problem (restates the prompt's line) and derives it again
    before it answers: with probability ``first`` after its first derivation, then with
    ``again`` after each re-derivation. The number of derivations is 1 with probability
    1 - ``first`` and geometric beyond, so most responses to a prompt are short and a few are
    many times longer: the within-prompt spread of reasoning traces."""

    first: float = 0.0
    again: float = 0.0

    def draw(self, rng: random.Random) -> int:
        """How many derivations a response makes."""
        if self.first <= 0 or rng.random() >= self.first:  # no draw: the shipped recipe's stream stays
            return 1
        count = 2
        while rng.random() < self.again:
            count += 1
        return count


# The "recheck" variant of the task (configs/tiny-cpu-recheck.yaml): prompts of median 2 steps and
# a policy warmed up on these rechecks. Drawn from this model (8.5 tokens a step, 896-token limit),
# a batch of 16 prompts x 8 responses has its longest response ~27x its median and a within-prompt
# sigma of log length of ~0.64, the shape of published reasoning traces; docs/example.md has what
# the warmed-up policy itself samples.
RECHECKS = Rechecks(first=0.25, again=0.85)
RECHECK_MEDIAN_STEPS = 2.0


def derivation(problem: Problem, *, rng: random.Random | None = None, error_rate: float = 0.0,
               rechecks: Rechecks = Rechecks()) -> str:
    """The step-by-step response for ``problem``.

    With ``error_rate`` > 0 each step's result is replaced, with that
    probability, by a wrong value, and the chain carries on from it: the
    imperfect demonstrations the warm-up policy learns from. ``rechecks``
    (needs ``rng``) repeats the derivation, each time after the prompt's line;
    the answer is the last derivation's.
    """
    blocks = []
    for _ in range(rechecks.draw(rng) if rng is not None else 1):
        lines, value = [], problem.start
        for remaining in range(problem.num_steps, 0, -1):
            result = apply_operation(value, problem.operation)
            if rng is not None and error_rate > 0 and rng.random() < error_rate:
                result = (result + rng.randrange(1, MODULUS)) % MODULUS
            lines.append(f"{remaining}:{value}{problem.operation}={result}")
            value = result
        blocks.append("\n".join(lines))
    return f"\n{problem.prompt_text()}\n".join(blocks) + f"\nAnswer: {value}"


def sample_num_steps(rng: random.Random, median: float = MEDIAN_STEPS) -> int:
    steps = round(math.exp(rng.gauss(math.log(median), SIGMA_STEPS)))
    return min(max(steps, 1), MAX_STEPS)


def sample_problem(rng: random.Random, num_steps: int | None = None, median_steps: float = MEDIAN_STEPS) -> Problem:
    n = sample_num_steps(rng, median_steps) if num_steps is None else num_steps
    if not 1 <= n <= MAX_STEPS:
        raise ValueError(f"num_steps must be in 1..{MAX_STEPS}, got {n}")
    return Problem(start=rng.randrange(MODULUS), operation=rng.choice(OPERATIONS), num_steps=n)


def to_row(problem: Problem, index: int) -> dict:
    """One dataset row in the verl schema."""
    return {
        "data_source": TASK_NAME,
        "prompt": [{"role": "user", "content": problem.prompt_text()}],
        "reward_model": {"ground_truth": str(problem.answer()), "style": "rule"},
        "extra_info": {"index": index, "num_steps": problem.num_steps},
    }


def generate_rows(n: int, seed: int, median_steps: float = MEDIAN_STEPS) -> list[dict]:
    """``n`` rows of the task, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [to_row(sample_problem(rng, median_steps=median_steps), i) for i in range(n)]


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
