"""Math answers checked with math-verify: the response's final (boxed) answer vs the ground truth."""
from __future__ import annotations

import time

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from rollpacker.reward.score import ERROR, NO_ANSWER, WRONG_ANSWER, Score

_GOLD = (LatexExtractionConfig(),)
_PREDICTION = (LatexExtractionConfig(), ExprExtractionConfig())


def score_math(response: str, ground_truth: str, timeout: float) -> Score:
    """Boxing the ground truth makes LaTeX extraction read all of it, whatever its form.

    math-verify enforces ``timeout`` itself (SIGALRM; this runs on a worker's main thread);
    the pool's hung-worker deadline backs it up.
    """
    start = time.monotonic()
    seconds = max(1, round(timeout))
    gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=_GOLD, parsing_timeout=seconds)
    if not gold:
        return Score.failed(ERROR, f"ground truth {ground_truth!r} does not parse",
                            time.monotonic() - start)
    prediction = parse(response, extraction_config=_PREDICTION, parsing_timeout=seconds)
    if not prediction:
        return Score.failed(NO_ANSWER, "no answer found in the response", time.monotonic() - start)
    if verify(gold, prediction, timeout_seconds=seconds):
        return Score.passed(time.monotonic() - start)
    return Score.failed(WRONG_ANSWER, f"{prediction[-1]} != {gold[-1]}", time.monotonic() - start)
