"""The built-in task's checker, through the pool (needs rollpacker.examples.task)."""
from __future__ import annotations

import random

from rollpacker.reward import RewardConfig, RewardPool


def test_stepchain_scores_through_the_pool():
    from rollpacker.examples.task import derivation, sample_problem

    problem = sample_problem(random.Random(0), num_steps=4)
    truth = str(problem.answer())
    wrong = str((problem.answer() + 1) % 100)
    with RewardPool(RewardConfig(num_workers=1)) as pool:
        scores = [pool.submit("stepchain", response, truth).result(timeout=60) for response in (
            derivation(problem), f"Answer: {wrong}", "the answer is " + truth)]
    assert [(s.reward, s.reason) for s in scores] == [(1.0, "ok"), (0.0, "wrong_answer"), (0.0, "no_answer")]
