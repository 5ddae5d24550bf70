"""What earlier attempts showed about each prompt, by ``Prompt.uid``.

RL runs go over the same prompts epoch after epoch, and a prompt's response
lengths are strongly correlated from one epoch to the next (what the
paper calls "history"). Tail batching without history rediscovers every epoch, at the
price of a failed short-round attempt, which prompts are long. The record
kept here lets the admission (``admission.HistoryAdmission``) send a prompt
seen long straight to the long-prompt queue; it changes only the order in
which prompts are rolled out, never which weights generate them.

One record per uid, in flat numpy columns indexed by uid (dataset uids are
dense row indices), so a million prompts cost ``BYTES_PER_PROMPT`` = 13 MB
and a lookup is an array read; the per-epoch shuffle of the data does not
matter because the key is the row, not its position.
"""
from __future__ import annotations

import enum
from typing import Any

import numpy as np

from rollpacker.sample import Prompt
from rollpacker.scheduler.config import HistoryConfig
from rollpacker.scheduler.round import RoundKind, RoundResult


class Outcome(enum.IntEnum):
    UNSEEN = 0
    SHORT = 1  # kept in a short round: its group finished before the round closed
    DEFERRED = 2  # lost a short round's race; ``length`` is that round's closing length, a lower bound
    LONG = 3  # kept in a long round: all R0 responses ran to their end
    FILTERED = 4  # completed, then dropped by dynamic sampling (no reward variance)


_COLUMNS = {  # name: (dtype, value of a prompt never seen)
    "outcome": (np.uint8, Outcome.UNSEEN),
    "length": (np.int32, 0),  # the group's completion length: its longest kept response, in tokens
    "epoch": (np.int32, -1),  # the prompt's epoch at that attempt
    "score_s": (np.float32, 0.0),  # the slowest scoring of the group's responses (reward-time outliers)
}
BYTES_PER_PROMPT = sum(np.dtype(dtype).itemsize for dtype, _ in _COLUMNS.values())


PROBE_MEMORY = 50  # probes: the precision estimate forgets older ones with weight 1 - 1/PROBE_MEMORY each


class PromptHistory:
    """Per-prompt records, the short rounds' closing length, and how well routing predicts.

    A short round closes when its P0-th group completes; its longest kept
    response is how long a prompt could take and still win. ``cutoff`` is the
    median of that over the last ``cutoff_rounds`` short rounds: a median,
    because a round that had to keep one long prompt (more long prompts than
    the over-launch absorbs) closes an order of magnitude later than the
    next. A prompt whose last group took longer than ``margin`` x ``cutoff``
    would lose the race now, so it is predicted long.

    Whether the prediction is worth acting on is measured, not assumed: a
    share of the predicted-long prompts (``probe_fraction``; all of them
    while routing is paused) race anyway, and ``precision`` is how often such
    a *probe* proved long (a Beta(1, 0) prior, then a moving average over
    about ``PROBE_MEMORY`` probes). Where lengths do not carry over between
    epochs, probes lose about as often as any racer and routing pauses.
    """

    def __init__(self, cfg: HistoryConfig) -> None:
        self.cfg = cfg
        self._cols = {name: np.full(0, fill, dtype) for name, (dtype, fill) in _COLUMNS.items()}
        self._closings: list[int] = []  # of the last ``cutoff_rounds`` short rounds, oldest first
        self._probes: set[tuple[int, int]] = set()  # (uid, epoch) of probes not yet raced
        self._probe_counts = [1.0, 1.0]  # probes that lost, probes raced (decayed; the prior counts one lost)

    @property
    def cutoff(self) -> float:
        return float(np.median(self._closings)) if self._closings else 0.0

    def __len__(self) -> int:
        """Prompts with a record."""
        return int(np.count_nonzero(self._cols["outcome"]))

    @property
    def nbytes(self) -> int:
        return sum(col.nbytes for col in self._cols.values())

    def outcome(self, uid: int) -> Outcome:
        return Outcome(self._cols["outcome"][uid]) if uid < self._size else Outcome.UNSEEN

    def length(self, uid: int) -> int:
        return int(self._cols["length"][uid]) if uid < self._size else 0

    def seen(self, uid: int) -> bool:
        return self.outcome(uid) is not Outcome.UNSEEN

    def predicts_long(self, uid: int) -> bool:
        """True when the last attempt lost a short race, or took longer than the races now close."""
        outcome = self.outcome(uid)
        if outcome is Outcome.UNSEEN:
            return False
        if outcome is Outcome.DEFERRED:
            return True
        cutoff = self.cutoff
        return cutoff > 0 and self.length(uid) > self.cfg.margin * cutoff

    @property
    def precision(self) -> float:
        return self._probe_counts[0] / self._probe_counts[1]

    @property
    def routing(self) -> bool:
        return self.precision >= self.cfg.min_precision

    def probe(self, prompt: Prompt) -> None:
        """``prompt`` is predicted long and races anyway: its race tells whether the prediction holds."""
        self._probes.add((prompt.uid, prompt.epoch))

    def observe(self, result: RoundResult) -> None:
        """Record what ``result`` showed about every prompt it launched."""
        kept_outcome = Outcome.SHORT if result.kind is RoundKind.SHORT else Outcome.LONG
        if result.kind is RoundKind.SHORT and result.kept:
            self._closings = [*self._closings, max(max(g.lengths) for g in result.kept)]
            self._closings = self._closings[-self.cfg.cutoff_rounds:]
            self._score_probes(result)
        for group in result.kept:
            self._record(group.prompt, kept_outcome, max(group.lengths), group.slowest_score)
        for prompt, tokens in zip(result.filtered, result.filtered_tokens):
            self._record(prompt, Outcome.FILTERED, tokens, 0.0)
        for prompt in result.deferred:
            self._record(prompt, Outcome.DEFERRED, round(self.cutoff), 0.0)

    def state_dict(self) -> dict[str, Any]:
        # tensors, so that a checkpoint of the scheduler loads with torch.load(weights_only=True);
        # (imported here: the scheduler package loads with every config, and so with every CLI's --help)
        import torch

        return {"closings": list(self._closings), "probes": sorted(self._probes),
                "probe_counts": list(self._probe_counts),
                **{name: torch.from_numpy(col.copy()) for name, col in self._cols.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._closings = [int(n) for n in state["closings"]]
        self._probes = {(int(uid), int(epoch)) for uid, epoch in state["probes"]}
        self._probe_counts = [float(n) for n in state["probe_counts"]]
        self._cols = {name: state[name].numpy().astype(dtype, copy=True) for name, (dtype, _) in _COLUMNS.items()}

    def _score_probes(self, result: RoundResult) -> None:
        """A probe proved long if it lost its race or, kept (a round without over-launch keeps every
        prompt), took longer than ``margin`` x the closing length."""
        threshold = self.cfg.margin * self.cutoff
        outcomes = {(p.uid, p.epoch): True for p in result.deferred}
        outcomes.update(((g.prompt.uid, g.prompt.epoch), max(g.lengths) > threshold) for g in result.kept)
        outcomes.update(((p.uid, p.epoch), n > threshold) for p, n in zip(result.filtered, result.filtered_tokens))
        keep = 1 - 1 / PROBE_MEMORY
        for key in self._probes & outcomes.keys():
            self._probes.discard(key)
            self._probe_counts = [keep * self._probe_counts[0] + outcomes[key], keep * self._probe_counts[1] + 1]

    @property
    def _size(self) -> int:
        return len(self._cols["outcome"])

    def _record(self, prompt: Prompt, outcome: Outcome, length: int, score_s: float) -> None:
        uid, size = prompt.uid, self._size
        if uid >= size:
            grow = max(uid + 1, 2 * size)
            for name, (dtype, fill) in _COLUMNS.items():
                col = np.full(grow, fill, dtype)
                col[:size] = self._cols[name]
                self._cols[name] = col
        for name, value in (("outcome", outcome), ("length", length), ("epoch", prompt.epoch), ("score_s", score_s)):
            self._cols[name][uid] = value
