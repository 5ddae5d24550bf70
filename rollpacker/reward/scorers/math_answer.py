"""Math answers checked with math-verify: the response's final answer vs the ground truth.

Which part of the response is the answer (``reward.math_extract``):

- ``boxed`` (default): the content of its last ``\\boxed{...}``; a response without one has no
  answer. What the prompts ask for ("output the final answer within \\boxed{}"), and what TRL's
  ``accuracy_reward``, DeepScaleR's scorer and veRL's MATH scorers read.
- ``last_expression``: math-verify's LaTeX extraction (a boxed answer first, else another LaTeX
  answer) and then any plain expression, the last one found winning, as veRL's ``math_verify``
  scorer reads it: ``"12 apples, then 7"`` answers 7.
"""
from __future__ import annotations

import time

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from rollpacker.reward.score import ERROR, NO_ANSWER, WRONG_ANSWER, Score
from rollpacker.reward.scorers.boxed import last_boxed

EXTRACT_MODES = ("boxed", "last_expression")
_LATEX = (LatexExtractionConfig(),)
_ANY_EXPRESSION = (LatexExtractionConfig(), ExprExtractionConfig())


def score_math(response: str, ground_truth: str, timeout: float, extract: str = "boxed") -> Score:
    """Boxing the ground truth (and a boxed answer) makes LaTeX extraction read all of it, whatever
    its form.

    math-verify enforces ``timeout`` itself (SIGALRM; this runs on a worker's main thread);
    the pool's hung-worker deadline backs it up.
    """
    start = time.monotonic()
    seconds = max(1, round(timeout))
    gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=_LATEX, parsing_timeout=seconds)
    if not gold:
        return Score.failed(ERROR, f"ground truth {ground_truth!r} does not parse",
                            time.monotonic() - start)
    if extract == "boxed":
        answer = last_boxed(response)
        prediction = [] if answer is None else parse(f"\\boxed{{{answer}}}", extraction_config=_LATEX,
                                                     parsing_timeout=seconds)
        missing = "no \\boxed{} answer in the response"
    elif extract == "last_expression":
        prediction = parse(response, extraction_config=_ANY_EXPRESSION, parsing_timeout=seconds)
        missing = "no answer found in the response"
    else:
        raise ValueError(f"math extract mode {extract!r}: expected one of {EXTRACT_MODES}")
    if not prediction:
        return Score.failed(NO_ANSWER, missing, time.monotonic() - start)
    if verify(gold, prediction, timeout_seconds=seconds):
        return Score.passed(time.monotonic() - start)
    return Score.failed(WRONG_ANSWER, f"{prediction[-1]} != {gold[-1]}", time.monotonic() - start)
