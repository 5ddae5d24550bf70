"""The last ``\\boxed{...}`` of a text: a math answer as the data converter and the math scorer read it."""
from __future__ import annotations


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces matched so ``\\boxed{\\frac{1}{2}}`` stays whole."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                answer = text[i + 1:j].strip()
                return answer or None
    return None  # unbalanced: the answer's end is unknown, so do not guess it
