"""Clocks: the scheduler reads time only through a ``Clock``.

``RealClock`` is wall time. ``VirtualClock`` only moves when told to: the
engine driver advances it to the next simulated event, so a whole rollout of
a modeled cluster runs in milliseconds and is exactly reproducible.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary, fixed origin; never decreases."""


class RealClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._on_advance: list[Callable[[], None]] = []

    def now(self) -> float:
        return self._now

    def on_advance(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` each time the clock has moved (what is due by the new time happens then)."""
        self._on_advance.append(fn)

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual clock cannot go back from {self._now} to {t}")
        self._now = float(t)
        for fn in self._on_advance:
            fn()
