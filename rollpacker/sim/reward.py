"""A modeled reward sink on the virtual clock: a score function plus a latency."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from rollpacker.sample import Sample
from rollpacker.scheduler.clock import VirtualClock


@dataclass(frozen=True)
class SimScore:
    reward: float
    correct: bool | None
    reason: str = "ok"


class _SimFuture:
    def __init__(self, clock: VirtualClock, ready_at: float, score: SimScore) -> None:
        self._clock, self._ready_at, self._score = clock, ready_at, score

    def done(self) -> bool:
        return self._clock.now() >= self._ready_at

    def result(self) -> SimScore:
        if not self.done():
            raise RuntimeError(f"score not ready until t={self._ready_at} (now {self._clock.now()})")
        return self._score


class SimRewardSink:
    """Scores ``reward_fn(sample)`` after ``latency_fn(sample)`` virtual seconds.

    It is an ``EventSource``: the engine driver advances the clock to the
    next score when the engines have nothing earlier.
    """

    def __init__(self, clock: VirtualClock, reward_fn: Callable[[Sample], float] = lambda s: 1.0,
                 latency_fn: Callable[[Sample], float] = lambda s: 0.0) -> None:
        self.clock, self.reward_fn, self.latency_fn = clock, reward_fn, latency_fn
        self._ready: list[float] = []

    def submit(self, sample: Sample, *, key: str | None = None, adapt: bool = True) -> _SimFuture:
        ready_at = self.clock.now() + self.latency_fn(sample)
        heapq.heappush(self._ready, ready_at)
        reward = float(self.reward_fn(sample))
        return _SimFuture(self.clock, ready_at, SimScore(reward, reward > 0))

    def next_event_time(self) -> float | None:
        while self._ready and self._ready[0] <= self.clock.now():
            heapq.heappop(self._ready)
        return self._ready[0] if self._ready else None
