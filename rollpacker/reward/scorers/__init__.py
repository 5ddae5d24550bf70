"""Scorers, one module each, chosen per sample by its ``data_source``."""
from __future__ import annotations

MATH, STEPCHAIN, CODE, JUDGE = "math", "stepchain", "code", "judge"
_MATH_ALIASES = ("math", "gsm8k", "aime", "amc", "olympiad", "numina", "deepscaler")
_CODE_ALIASES = ("code", "apps", "taco", "livecodebench", "primeintellect")


def scorer_for(data_source: str) -> str:
    """The scorer that handles ``data_source``; ValueError naming it if none does."""
    name = data_source.strip().lower()
    if name == STEPCHAIN:
        return STEPCHAIN
    if name in (JUDGE, "llm_judge"):
        return JUDGE
    if any(alias in name for alias in _CODE_ALIASES):
        return CODE
    if any(alias in name for alias in _MATH_ALIASES):
        return MATH
    raise ValueError(
        f"no scorer for data_source {data_source!r}: expected {STEPCHAIN!r}, {JUDGE!r}, a code source "
        f"(containing one of {_CODE_ALIASES}) or a math source (containing one of {_MATH_ALIASES})")
