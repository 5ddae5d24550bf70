"""Response-length traces: read from JSONL, or drawn from a long-tail model.

Trace file: one JSON object per line, one line per prompt::

    {"prompt_id": "aime-12", "lengths": [812, 455, 16384, ...], "prompt_length": 180}

``lengths`` are response lengths (tokens) of independent samples of that
prompt; ``prompt_length`` is optional (default 256). Blank lines are skipped.

Parametric model (``longtail_trace``): each prompt has a log-normal median
length (``median`` x exp(N(0, sigma_prompt))) and each response multiplies it
by exp(N(0, sigma_response)). With sigma_prompt = 0.8 and sigma_response =
0.65 (total 1.03), the longest of 1024 responses in a step is about e^(3.2 x
1.03) ≈ 27x the median, inside the published 25–32x; with ``median`` =
limit / 28 the step's longest response reaches the length limit, as in the
published traces.
"""
from __future__ import annotations

from rollpacker.rollout.engine import GenerationRequest

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPT_LENGTH = 256


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class PromptLengths:
    prompt_id: str
    lengths: tuple[int, ...]
    prompt_length: int = DEFAULT_PROMPT_LENGTH


def load_trace(path: str | Path) -> list[PromptLengths]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror}") from None
    out: list[PromptLengths] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            out.append(_parse_line(line, f"{path}:{lineno}"))
    if not out:
        raise TraceError(f"{path}:1: empty trace: expected one JSON object per line, "
                         '{"prompt_id": ..., "lengths": [...]}')
    return out


def _parse_line(line: str, where: str) -> PromptLengths:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("prompt_id", "lengths"):
        if key not in row:
            raise TraceError(f"{where}: missing field {key!r}")
    lengths = row["lengths"]
    if not isinstance(lengths, list) or not lengths:
        raise TraceError(f"{where}: 'lengths' must be a non-empty list of response lengths")
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise TraceError(f"{where}: lengths[{i}] = {n!r}; response lengths must be integers >= 1")
    prompt_length = row.get("prompt_length", DEFAULT_PROMPT_LENGTH)
    if not isinstance(prompt_length, int) or isinstance(prompt_length, bool) or prompt_length < 1:
        raise TraceError(f"{where}: prompt_length = {prompt_length!r}; must be an integer >= 1")
    return PromptLengths(str(row["prompt_id"]), tuple(lengths), prompt_length)


def longtail_trace(num_prompts: int, *, samples: int, median: float, limit: int, sigma_prompt: float = 0.8,
                   sigma_response: float = 0.65, prompt_length: int = DEFAULT_PROMPT_LENGTH,
                   seed: int = 0) -> list[PromptLengths]:
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        prompt_median = median * rng.lognormvariate(0.0, sigma_prompt)
        lengths = tuple(max(1, min(limit, round(prompt_median * rng.lognormvariate(0.0, sigma_response))))
                        for _ in range(samples))
        out.append(PromptLengths(f"synthetic-{i}", lengths, prompt_length))
    return out


class LengthOracle:
    """How long the response of a request will be.

    The first attempt at response r of a prompt is the trace's r-th sample;
    a prompt run again (deferred, or in a later epoch) draws fresh samples,
    with replacement, from its own list, as regeneration from scratch would.
    An attempt is a (request id, sampling seed) pair: a request resubmitted
    under the same seed (migrated to another engine) continues the same
    response, so it keeps its length.
    """

    def __init__(self, trace: list[PromptLengths], seed: int = 0) -> None:
        self.trace = trace
        self.seed = seed
        self._attempts: Counter[tuple[int, int]] = Counter()
        self._attempt_of: dict[tuple[str, int], int] = {}

    def __call__(self, request: GenerationRequest) -> int:
        key = parse_request_id(request.request_id)
        seed = request.params.seed
        attempt = self._attempt_of.get((request.request_id, seed)) if seed is not None else None
        if attempt is None:
            attempt = self._attempts[key]
            self._attempts[key] += 1
            if seed is not None:
                self._attempt_of[request.request_id, seed] = attempt
        lengths = self.trace[key[0]].lengths
        if attempt == 0 and key[1] < len(lengths):
            return lengths[key[1]]
        return random.Random(f"{self.seed}/{key}/{attempt}").choice(lengths)


def parse_request_id(request_id: str) -> tuple[int, int]:
    """(prompt uid, response index) from ``Sample.request_id`` (``p{uid}e{epoch}r{index}``)."""
    head, _, index = request_id.rpartition("r")
    uid = head[1:].partition("e")[0]
    if not (request_id.startswith("p") and uid.isdigit() and index.isdigit()):
        raise ValueError(f"not a Sample request id: {request_id!r}")
    return int(uid), int(index)
