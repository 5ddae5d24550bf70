"""Response-length traces: read from JSONL, or drawn from a long-tail model.

Trace file: one JSON object per line::

    {"prompt_id": "aime-12", "lengths": [812, 455, 16384, ...], "prompt_length": 180}
    {"prompt_id": "aime-13", "epoch": 0, "lengths": [390, 1204, ...]}
    {"prompt_id": "aime-13", "epoch": 1, "lengths": [610, 2210, ...]}

``lengths`` are response lengths (tokens) of independent samples of that
prompt; ``prompt_length`` is optional (default 256). Blank lines are skipped.
A row without ``epoch`` is one prompt whose samples hold in every epoch. Rows
with ``epoch`` (an integer >= 0) give one prompt's samples in that epoch of
training, so a trace can follow response lengths as RL training moves them;
all rows of a ``prompt_id`` then carry an epoch, one row per epoch, and a run
that reaches an epoch a prompt has no row for stops with ``TraceError``.

Parametric model (``longtail_trace``): each prompt has a log-normal median
length (``median`` x exp(N(0, sigma_prompt))) and each response multiplies it
by exp(N(0, sigma_response)). With sigma_prompt = 0.8 and sigma_response =
0.65 (total 1.03), the longest of 1024 responses in a step is about e^(3.2 x
1.03) ≈ 27x the median, inside the published 25–32x; with ``median`` =
limit / 28 the step's longest response reaches the length limit, as in the
published traces. ``multi_epoch_trace`` lets the per-prompt median move from
epoch to epoch (an AR(1) latent with correlation ``rho``, plus a drift), the
setting in which a prompt's past length predicts its next one only partly.
"""
from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rollpacker.rollout.engine import GenerationRequest
from rollpacker.stats import spearman

DEFAULT_PROMPT_LENGTH = 256


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file and line, or the prompt and epoch."""


@dataclass(frozen=True)
class PromptLengths:
    """One prompt's response-length samples.

    ``by_epoch`` None: ``lengths`` are its samples in every epoch. Otherwise
    ``by_epoch[e]`` are its samples in epoch e and ``lengths`` repeats those of
    its first traced epoch, for readers that look at a single epoch.
    """

    prompt_id: str
    lengths: tuple[int, ...]
    prompt_length: int = DEFAULT_PROMPT_LENGTH
    by_epoch: Mapping[int, tuple[int, ...]] | None = None

    def lengths_in(self, epoch: int) -> tuple[int, ...]:
        if self.by_epoch is None:
            return self.lengths
        if epoch not in self.by_epoch:
            raise TraceError(f"prompt {self.prompt_id!r} has no lengths for epoch {epoch}; the trace gives it "
                             f"epochs {sorted(self.by_epoch)}")
        return self.by_epoch[epoch]


def per_epoch(prompt_id: str, by_epoch: Mapping[int, tuple[int, ...]],
              prompt_length: int = DEFAULT_PROMPT_LENGTH) -> PromptLengths:
    """A prompt traced epoch by epoch."""
    return PromptLengths(prompt_id, by_epoch[min(by_epoch)], prompt_length, dict(by_epoch))


@dataclass(frozen=True)
class _Row:
    where: str
    prompt_id: str
    lengths: tuple[int, ...]
    prompt_length: int
    epoch: int | None


def load_trace(path: str | Path) -> list[PromptLengths]:
    """The prompts of a trace file, in the order of their first line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror}") from None
    rows = [_parse_line(line, f"{path}:{lineno}") for lineno, line in enumerate(text.splitlines(), start=1)
            if line.strip()]
    if not rows:
        raise TraceError(f"{path}:1: empty trace: expected one JSON object per line, "
                         '{"prompt_id": ..., "lengths": [...]}')
    # Rows without an epoch stay one prompt each (repeated ids included, as before epochs existed);
    # epoch rows of one id gather into the slot of its first row.
    slots: list[_Row | list[_Row]] = []
    epoch_rows: dict[str, list[_Row]] = {}
    plain: dict[str, _Row] = {}
    for row in rows:
        if row.epoch is None:
            if row.prompt_id in epoch_rows:
                raise TraceError(f"{row.where}: prompt_id {row.prompt_id!r} has no 'epoch' here but has one at "
                                 f"{epoch_rows[row.prompt_id][0].where}; give every row of a prompt an epoch or none")
            plain.setdefault(row.prompt_id, row)
            slots.append(row)
            continue
        if row.prompt_id in plain:
            raise TraceError(f"{row.where}: prompt_id {row.prompt_id!r} has an 'epoch' here but none at "
                             f"{plain[row.prompt_id].where}; give every row of a prompt an epoch or none")
        group = epoch_rows.get(row.prompt_id)
        if group is None:
            group = epoch_rows[row.prompt_id] = []
            slots.append(group)
        for other in group:
            if other.epoch == row.epoch:
                raise TraceError(f"{row.where}: prompt_id {row.prompt_id!r} epoch {row.epoch} is already given "
                                 f"at {other.where}")
            if other.prompt_length != row.prompt_length:
                raise TraceError(f"{row.where}: prompt_id {row.prompt_id!r} has prompt_length {row.prompt_length} "
                                 f"here but {other.prompt_length} at {other.where}")
        group.append(row)
    return [PromptLengths(s.prompt_id, s.lengths, s.prompt_length) if isinstance(s, _Row)
            else per_epoch(s[0].prompt_id, {r.epoch: r.lengths for r in s}, s[0].prompt_length)
            for s in slots]


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _parse_line(line: str, where: str) -> _Row:
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
        if not _is_int(n, 1):
            raise TraceError(f"{where}: lengths[{i}] = {n!r}; response lengths must be integers >= 1")
    prompt_length = row.get("prompt_length", DEFAULT_PROMPT_LENGTH)
    if not _is_int(prompt_length, 1):
        raise TraceError(f"{where}: prompt_length = {prompt_length!r}; must be an integer >= 1")
    epoch = row.get("epoch")
    if epoch is not None and not _is_int(epoch, 0):
        raise TraceError(f"{where}: epoch = {epoch!r}; must be an integer >= 0 (or absent: every epoch)")
    return _Row(where, str(row["prompt_id"]), tuple(lengths), prompt_length, epoch)


def _clipped(value: float, limit: int) -> int:
    return max(1, min(limit, round(value)))


def longtail_trace(num_prompts: int, *, samples: int, median: float, limit: int, sigma_prompt: float = 0.8,
                   sigma_response: float = 0.65, prompt_length: int = DEFAULT_PROMPT_LENGTH,
                   seed: int = 0) -> list[PromptLengths]:
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        prompt_median = median * rng.lognormvariate(0.0, sigma_prompt)
        lengths = tuple(_clipped(prompt_median * rng.lognormvariate(0.0, sigma_response), limit)
                        for _ in range(samples))
        out.append(PromptLengths(f"synthetic-{i}", lengths, prompt_length))
    return out


def multi_epoch_trace(num_prompts: int, epochs: int, *, samples: int, median: float, limit: int,
                      sigma_prompt: float = 0.8, sigma_response: float = 0.65, rho: float, drift: float = 0.0,
                      prompt_length: int = DEFAULT_PROMPT_LENGTH, seed: int = 0) -> list[PromptLengths]:
    """The long-tail model over ``epochs`` epochs, with per-prompt medians that move.

    Prompt i has a latent z_{i,0} ~ N(0, 1) and z_{i,e} = rho z_{i,e-1} +
    sqrt(1 - rho^2) N(0, 1), so z stays N(0, 1) in every epoch and corr(z_e,
    z_{e+1}) = rho; its median in epoch e is median x exp(sigma_prompt z_{i,e}
    + drift e) (drift > 0: responses lengthen as training goes on) and each
    response multiplies that by exp(N(0, sigma_response)), clipped to
    [1, limit]. The draws do not depend on ``rho`` or ``drift``, so under one
    seed the trace moves smoothly with them (what ``calibrate_rho`` needs).
    """
    if not -1.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [-1, 1], got {rho}")
    if num_prompts < 1 or epochs < 1 or samples < 1:
        raise ValueError(f"num_prompts, epochs and samples must be >= 1, got {num_prompts}, {epochs}, {samples}")
    rng = random.Random(seed)
    innovation = math.sqrt(1.0 - rho * rho)
    out = []
    for i in range(num_prompts):
        z = rng.gauss(0.0, 1.0)
        by_epoch = {}
        for e in range(epochs):
            if e:
                z = rho * z + innovation * rng.gauss(0.0, 1.0)
            prompt_median = median * math.exp(sigma_prompt * z + drift * e)
            by_epoch[e] = tuple(_clipped(prompt_median * rng.lognormvariate(0.0, sigma_response), limit)
                                for _ in range(samples))
        out.append(per_epoch(f"synthetic-{i}", by_epoch, prompt_length))
    return out


def epoch_spearman(trace: list[PromptLengths]) -> float:
    """Mean over consecutive epochs (e, e+1) of the Spearman correlation of the
    per-prompt mean response length, over prompts traced in both epochs: how
    well a prompt's length in one epoch ranks it in the next. Prompts without
    per-epoch rows repeat the same samples and carry no such signal; they are
    left out."""
    traced = [p for p in trace if p.by_epoch is not None]
    epochs = sorted({e for p in traced for e in p.by_epoch})
    values = []
    for e in epochs[:-1]:
        pairs = [(statistics.fmean(p.by_epoch[e]), statistics.fmean(p.by_epoch[e + 1]))
                 for p in traced if e in p.by_epoch and e + 1 in p.by_epoch]
        if len(pairs) >= 2:
            values.append(spearman([a for a, _ in pairs], [b for _, b in pairs]))
    if not values:
        raise ValueError("epoch_spearman needs >= 2 prompts traced in two consecutive epochs")
    return statistics.fmean(values)


def calibrate_rho(target: float, num_prompts: int, epochs: int, *, tolerance: float = 0.005,
                  **model: Any) -> float:
    """The ``rho`` of ``multi_epoch_trace(num_prompts, epochs, **model)`` whose
    realized ``epoch_spearman`` is ``target`` (within ``tolerance``), by
    bisection on [0, 1] (measured over at least the two epochs a correlation
    needs). Response noise caps the realized correlation below 1 even at
    rho = 1; a target above that cap is refused."""
    epochs = max(2, epochs)

    def realized(rho: float) -> float:
        return epoch_spearman(multi_epoch_trace(num_prompts, epochs, rho=rho, **model))

    lo, hi = 0.0, 1.0
    cap = realized(hi)
    if target > cap + tolerance:
        raise ValueError(f"a realized Spearman of {target} is out of reach: rho = 1 gives {cap:.3f} "
                         f"(lower sigma_response or raise samples)")
    for _ in range(40):
        mid = (lo + hi) / 2
        value = realized(mid)
        if abs(value - target) <= tolerance:
            return mid
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return (lo + hi) / 2


class LengthOracle:
    """How long the response of a request will be.

    The first attempt at response r of a prompt in an epoch is the r-th
    sample of that epoch's list; a prompt run again (deferred and
    regenerated) draws fresh samples, with replacement, from the same list,
    as regeneration from scratch would. A prompt traced without epochs has
    one list for all epochs, and attempts count on across them: a later
    epoch draws fresh samples from it. An attempt is a (request id, sampling
    seed) pair: a request resubmitted under the same seed (migrated to
    another engine) continues the same response, so it keeps its length.

    ``last_epoch``: epochs after it read its samples instead of their own,
    for a run that goes past the epochs it measures (to drain a queue).
    """

    def __init__(self, trace: list[PromptLengths], seed: int = 0, *, last_epoch: int | None = None) -> None:
        self.trace = trace
        self.seed = seed
        self.last_epoch = last_epoch
        self._attempts: Counter[tuple[int, ...]] = Counter()
        self._attempt_of: dict[tuple[str, int], int] = {}

    def __call__(self, request: GenerationRequest) -> int:
        uid, epoch, index = parse_request_id(request.request_id)
        if self.last_epoch is not None:
            epoch = min(epoch, self.last_epoch)
        prompt = self.trace[uid]
        key = (uid, index) if prompt.by_epoch is None else (uid, epoch, index)
        lengths = prompt.lengths_in(epoch)
        seed = request.params.seed
        attempt = self._attempt_of.get((request.request_id, seed)) if seed is not None else None
        if attempt is None:
            attempt = self._attempts[key]
            self._attempts[key] += 1
            if seed is not None:
                self._attempt_of[request.request_id, seed] = attempt
        if attempt == 0 and index < len(lengths):
            return lengths[index]
        return random.Random(f"{self.seed}/{key}/{attempt}").choice(lengths)


def parse_request_id(request_id: str) -> tuple[int, int, int]:
    """(prompt uid, epoch, response index) from ``Sample.request_id`` (``p{uid}e{epoch}r{index}``)."""
    uid, _, rest = request_id[1:].partition("e")
    epoch, _, index = rest.partition("r")
    if not (request_id.startswith("p") and uid.isdigit() and epoch.isdigit() and index.isdigit()):
        raise ValueError(f"not a Sample request id: {request_id!r}")
    return int(uid), int(epoch), int(index)
