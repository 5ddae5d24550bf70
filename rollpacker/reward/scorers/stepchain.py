"""The built-in task's checker (``rollpacker.examples.task``), imported lazily."""
from __future__ import annotations

import time

from rollpacker.reward.score import Score


def score_stepchain(response: str, ground_truth: str) -> Score:
    from rollpacker.examples.task import score_response

    start = time.monotonic()
    correct, reason = score_response(response, ground_truth)
    seconds = time.monotonic() - start
    return Score.passed(seconds) if correct else Score.failed(reason, seconds=seconds)
