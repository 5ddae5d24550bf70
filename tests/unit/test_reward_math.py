"""Math answers: an equivalence table through math-verify, the two ways of reading the answer, and
routing by data_source."""
from __future__ import annotations

import pytest

from rollpacker.reward.scorers import CODE, JUDGE, MATH, STEPCHAIN, scorer_for
from rollpacker.reward.scorers.math_answer import EXTRACT_MODES, score_math

EQUIVALENT = [
    ("3/4", r"The answer is $\boxed{0.75}$."),  # fraction vs decimal
    ("0.75", r"so \boxed{\frac{3}{4}}"),
    (r"\frac{3}{4}", r"\boxed{\frac34}"),
    ("3/4", r"\boxed{\boxed{3/4}}"),  # nested boxes
    (r"\sqrt{2}/2", r"\boxed{\frac{\sqrt 2}{2}}"),
    (r"2\pi", r"\boxed{2 \pi}"),  # LaTeX spacing
    ("x^2+1", r"\boxed{1 + x^{2}}"),
    ("5", r"\boxed{5\text{ cm}}"),  # units
    ("5", r"\boxed{5 \text{ meters}}"),
    ("5", r"\boxed{5\,\mathrm{cm}}"),
    ("[1,2)", r"\boxed{[1, 2)}"),  # intervals
    (r"\{1,2\}", r"\boxed{\{2,1\}}"),  # sets
]
NOT_EQUIVALENT = [
    ("3/4", r"\boxed{0.7}"),
    ("1/3", r"\boxed{0.333}"),
    ("(1,2]", r"\boxed{[1,2]}"),  # open vs closed end
    ("5", r"\boxed{6\text{ cm}}"),
    (r"2\pi", r"\boxed{\pi}"),
    ("x^2+1", r"\boxed{x^2-1}"),
]


@pytest.mark.parametrize("truth,response", EQUIVALENT)
def test_equivalent_answers_score_one(truth, response):
    score = score_math(response, truth, timeout=5)
    assert (score.reward, score.correct, score.reason) == (1.0, True, "ok"), score


@pytest.mark.parametrize("truth,response", NOT_EQUIVALENT)
def test_different_answers_score_zero(truth, response):
    score = score_math(response, truth, timeout=5)
    assert (score.reward, score.correct, score.reason) == (0.0, False, "wrong_answer"), score


def test_response_without_answer_is_no_answer():
    assert score_math("I am not sure.", "7", timeout=5).reason == "no_answer"


# (response, truth, boxed reading, last-expression reading): hand-made responses where the two differ
READINGS = [
    ("no box here, but 12 apples then 7", "7", "no_answer", "ok"),
    ("Final answer: 12", "12", "no_answer", "ok"),
    # a corrected answer: the boxed reading takes the last box, math-verify's own extraction the first
    (r"First \boxed{3}, then I fix it: \boxed{4}", "4", "ok", "wrong_answer"),
    (r"The answer is \boxed{4}. Check: 2 + 2 = 5", "4", "ok", "ok"),  # math-verify prefers a box too
    (r"\boxed{\frac{1}{2}} and 0.3 are close", "1/2", "ok", "ok"),
]


@pytest.mark.parametrize("response,truth,boxed,last_expression", READINGS)
def test_boxed_reads_only_the_last_box_and_last_expression_reads_any_expression(response, truth, boxed,
                                                                                  last_expression):
    got = {mode: score_math(response, truth, timeout=5, extract=mode).reason for mode in EXTRACT_MODES}
    print(f"{response!r} vs {truth!r}: {got}")
    assert got == {"boxed": boxed, "last_expression": last_expression}


def test_boxed_is_the_default_and_an_unknown_mode_is_named():
    assert score_math("12 apples then 7", "7", timeout=5).reason == "no_answer"
    with pytest.raises(ValueError, match="'last_box'"):
        score_math(r"\boxed{7}", "7", timeout=5, extract="last_box")


@pytest.mark.parametrize("source,scorer", [
    ("math", MATH), ("openai/gsm8k", MATH), ("AIME-2024", MATH), ("lighteval/MATH", MATH),
    ("code", CODE), ("codecontests", CODE), ("stepchain", STEPCHAIN), ("judge", JUDGE)])
def test_data_source_routing(source, scorer):
    assert scorer_for(source) == scorer


def test_unknown_data_source_is_named():
    with pytest.raises(ValueError, match="'poetry'"):
        scorer_for("poetry")
