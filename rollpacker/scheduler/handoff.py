"""When a long round hands rollout engines to the stream trainer.

In a long round, once ``low``–``high`` of its requests are done (checked each
time another ``check_every`` of them finishes), up to ``max_share`` of the
round's engines stop generating and their ranks start training on the groups
already finished. Their running requests migrate to the engines that stay,
keeping the tokens generated so far (the KV cache is rebuilt by recompute).

Engines are released only whole and only from ``candidates`` (the program
lists the engines whose ranks form whole training replicas, never the
coordinator's own), and only as many as the projected KV peak allows: the
KV in use now, plus for every request still running the mean length of the
responses already done, must fit in the capacity of the engines that stay.
The first check point that can release at least one engine fires; a round
hands off at most once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from rollpacker.configlib import ConfigError
from rollpacker.rollout.engine import EngineStats


@dataclass(frozen=True)
class HandoffPolicy:
    candidates: tuple[int, ...]  # engine indices that may be released, in release order
    on_release: Callable[[list[int]], None]  # the program moves the released engines' ranks to training
    low: float = 0.2
    high: float = 0.5
    check_every: float = 0.05
    max_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high < 1:
            raise ConfigError(f"need 0 < low <= high < 1, got low={self.low}, high={self.high}")
        if not 0 < self.check_every <= 1 or not 0 < self.max_share <= 1:
            raise ConfigError("check_every and max_share must be in (0, 1]")


class HandoffTrigger:
    """One round's trigger state: ``decide`` is called after every finished request."""

    def __init__(self, policy: HandoffPolicy, total_requests: int, num_engines: int):
        self.policy, self.total = policy, total_requests
        self.limit = min(len(policy.candidates), math.floor(policy.max_share * num_engines))
        self.fired_at: float | None = None  # fraction of requests done when it fired
        self._next_check = 1

    def decide(self, done: int, response_tokens: int, running: int,
               stats: Callable[[], Sequence[EngineStats]]) -> list[int]:
        """Engines to release now (empty: not now). ``done`` requests finished so far with
        ``response_tokens`` in all; ``running`` still outstanding; ``stats()`` per engine."""
        if self.fired_at is not None or self.limit == 0:
            return []
        step = max(1, math.ceil(self.policy.check_every * self.total))
        if done < self._next_check * step:
            return []
        self._next_check = done // step + 1
        fraction = done / self.total
        if not self.policy.low <= fraction <= self.policy.high:
            return []
        per_engine = list(stats())
        projected = sum(s.kv_tokens_used for s in per_engine) + running * response_tokens / max(1, done)
        chosen = list(self.policy.candidates[:self.limit])
        while chosen:
            staying = sum(s.kv_tokens_capacity for i, s in enumerate(per_engine) if i not in chosen)
            if projected <= staying:
                self.fired_at = fraction
                return chosen
            chosen.pop()
        return []
