"""Per-test-case code timeouts that follow the runtimes of correct solutions: a slow correct
solution is not cut off, and a stuck one is not waited on for the worst case.

T = min(max(T_min, λ·T_anchor), T_max), where T_anchor is the longest runtime of
a solution that passed that test case so far.  A case no solution has passed
yet gets T_max: there is no evidence that it can be solved faster.  Anchors
only grow, so a slow but correct solution is never cut off later by a timeout
that an earlier, faster one set.
"""
from __future__ import annotations

import threading
from typing import Any

from rollpacker.reward.config import RewardConfig


class CodeTimeouts:
    """Thread-safe: the pool's submitters read it while its dispatcher updates it."""

    def __init__(self, cfg: RewardConfig):
        self._adaptive = cfg.code_timeout == "adaptive"
        self._fixed = cfg.code_fixed_timeout
        self._t_min, self._t_max, self._lambda = cfg.code_t_min, cfg.code_t_max, cfg.code_lambda
        self._anchors: dict[str, float] = {}
        self._grown: set[str] = set()  # anchors observed here since the last ``take_grown``
        self._lock = threading.Lock()

    @staticmethod
    def case_key(prompt_key: str, index: int) -> str:
        return f"{prompt_key}#{index}"

    def timeouts(self, prompt_key: str, num_cases: int) -> tuple[float, ...]:
        if not self._adaptive:
            return (self._fixed,) * num_cases
        with self._lock:
            anchors = [self._anchors.get(self.case_key(prompt_key, i)) for i in range(num_cases)]
        return tuple(self._t_max if a is None else min(max(self._t_min, self._lambda * a), self._t_max)
                     for a in anchors)

    def observe(self, prompt_key: str, passed: dict[int, float]) -> None:
        """Record the runtimes (seconds) of test cases a solution passed, by case index."""
        with self._lock:
            for index, seconds in passed.items():
                key = self.case_key(prompt_key, index)
                if seconds > self._anchors.get(key, -1.0):
                    self._anchors[key] = seconds
                    self._grown.add(key)

    def anchor(self, prompt_key: str, index: int) -> float | None:
        with self._lock:
            return self._anchors.get(self.case_key(prompt_key, index))

    def take_grown(self) -> dict[str, float]:
        """The anchors observed here that grew since the last call: what this pool tells the others."""
        with self._lock:
            grown = {k: self._anchors[k] for k in self._grown}
            self._grown.clear()
        return grown

    def merge(self, anchors: dict[str, float]) -> None:
        """Anchors another pool observed (``take_grown``): each case keeps the longer runtime."""
        with self._lock:
            for key, seconds in anchors.items():
                self._anchors[key] = max(self._anchors.get(key, 0.0), float(seconds))

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"anchors": dict(self._anchors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        anchors = state.get("anchors")
        if not isinstance(anchors, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in anchors.items()):
            raise ValueError("reward state_dict: 'anchors' must map test-case keys to runtimes in seconds >= 0")
        with self._lock:
            self._anchors = {k: float(v) for k, v in anchors.items()}
