"""A modeled reward sink on the virtual clock: a score function plus a latency."""
from __future__ import annotations

import heapq
import itertools
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from rollpacker.sample import Sample
from rollpacker.scheduler.clock import VirtualClock


@dataclass(frozen=True)
class SimScore:
    reward: float
    correct: bool | None
    reason: str = "ok"


class SimRewardSink:
    """Scores ``reward_fn(sample)`` after ``latency_fn(sample)`` virtual seconds of one of ``workers``
    worker processes (None: as many as there are samples), taken in submission order.

    Each score is a real future, resolved when the clock reaches its time. The sink is an
    ``EventSource``: the fleet advances the clock to the next score when the engines have nothing
    earlier.
    """

    def __init__(self, clock: VirtualClock, reward_fn: Callable[[Sample], float] = lambda s: 1.0,
                 latency_fn: Callable[[Sample], float] = lambda s: 0.0, workers: int | None = None) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1 or None, got {workers}")
        self.clock, self.reward_fn, self.latency_fn = clock, reward_fn, latency_fn
        self._pending: list[tuple[float, int, Future, SimScore]] = []  # (due, submission order, ...)
        self._submitted = itertools.count()
        self._free_at = [0.0] * workers if workers else None  # a heap: when each worker is next free
        clock.on_advance(self._resolve_due)

    def submit(self, sample: Sample, *, key: str | None = None, adapt: bool = True) -> Future:
        start = self.clock.now()
        if self._free_at is not None:
            start = max(start, heapq.heappop(self._free_at))
        due = start + self.latency_fn(sample)
        if self._free_at is not None:
            heapq.heappush(self._free_at, due)
        reward = float(self.reward_fn(sample))
        future: Future = Future()
        heapq.heappush(self._pending, (due, next(self._submitted), future, SimScore(reward, reward > 0)))
        self._resolve_due()
        return future

    def next_event_time(self) -> float | None:
        return self._pending[0][0] if self._pending else None

    def _resolve_due(self) -> None:
        while self._pending and self._pending[0][0] <= self.clock.now():
            _, _, future, score = heapq.heappop(self._pending)
            future.set_result(score)
