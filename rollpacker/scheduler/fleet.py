"""How a round's engines are reached when they are in this process: ``LocalFleet``.

Each engine runs its share of the round as a ``GroupRace`` (group_race.py) here, on a real clock
(rank 0's own engine, a test's or a benchmark's) or on a ``VirtualClock`` (a modeled cluster). On a
virtual clock nothing moves by itself: before looking at the races the fleet asks every
``EventSource`` (the modeled engines, a reward model with latency) for its next event and advances
the clock to the earliest, and each engine then simulates itself up to the new time.

Engines that other ranks lead are reached through ``control.fleet.ClusterFleet``, which races rank
0's own engines through a ``LocalFleet`` and takes the others' news from their servers. Both are
the ``protocols.Fleet`` that ``EngineDriver`` drives.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, Iterable, Sequence

from rollpacker.rollout.engine import RolloutEngine
from rollpacker.scheduler.calls import Call, Retire, apply, replies
from rollpacker.scheduler.clock import Clock, VirtualClock
from rollpacker.scheduler.group_race import GroupRace, RaceNews
from rollpacker.scheduler.protocols import EventSource, RewardSink

News = list[tuple[int, RaceNews]]

# with no engine generating, only a score (which wakes the fleet) brings news; the bound keeps a
# reward sink that never calls back from hanging the round silently
_SCORE_WAIT_S = 1.0


class StalledError(RuntimeError):
    """Groups are open but nothing can make progress (virtual clock)."""


class LocalFleet:
    """``engines`` raced in this process and scored by ``reward``; a wait blocks on one of them
    for at most ``idle_poll_s``, or, when none generates, until a score comes. ``wake`` is also
    called (from the reward pool's thread) when a score comes."""

    def __init__(self, engines: Sequence[RolloutEngine], clock: Clock, reward: RewardSink | None, *,
                 idle_poll_s: float = 0.005, wake: Callable[[], None] = lambda: None) -> None:
        if engines and reward is None:
            raise ValueError("engines raced in this process need a reward sink")
        self.clock, self.reward, self._idle_poll_s = clock, reward, idle_poll_s
        self._virtual = isinstance(clock, VirtualClock)
        if self._virtual and (not_simulated := [e.engine_id for e in engines if not isinstance(e, EventSource)]):
            raise TypeError(f"engines {not_simulated} cannot tell their next event; a VirtualClock needs simulated "
                            "engines")
        self._also_wake = wake
        self._woken = threading.Event()  # a score came since the races were last stepped
        self.races = [GroupRace(e, reward, clock, wake=self.wake) for e in engines]
        self._sources = [*engines, *([reward] if isinstance(reward, EventSource) else [])]
        self.retired: set[int] = set()  # engines handed to training: not stepped, their events not awaited
        self._next_blocking = 0

    @property
    def size(self) -> int:
        return len(self.races)

    def wake(self) -> None:
        self._woken.set()
        self._also_wake()

    def open_round(self, progress: bool) -> None:
        """In-process races tell every response generated anyway."""

    def close_round(self) -> None:
        pass

    def call(self, calls: Iterable[tuple[int, Call]]) -> list:
        return replies(self.begin(i, call) for i, call in calls)

    def begin(self, i: int, call: Call) -> Callable[[], object]:
        """``call`` on race ``i``, made when the returned function is called."""
        if isinstance(call, Retire):
            self.retired.add(i)
        return functools.partial(apply, self.races[i], call)

    def poll(self, wait: bool = False) -> News:
        if self._virtual:
            self._advance_virtual_clock()
        self._woken.clear()  # a score from here on ends the wait below at once
        news = [(i, n) for i, race in enumerate(self.races) if i not in self.retired and (n := race.step(0.0))]
        if news or not wait:
            return news
        news = self.block_on_one(range(self.size))
        if news is None and not self._virtual:
            self._woken.wait(_SCORE_WAIT_S)
        return news or []

    def block_on_one(self, among: Iterable[int]) -> News | None:
        """Step one of the races ``among`` that are generating (in turn), waiting up to
        ``idle_poll_s`` for a completion; None when none is generating."""
        generating = [i for i in among if i not in self.retired and self.races[i].generating]
        if not generating:
            return None
        i = generating[self._next_blocking % len(generating)]
        self._next_blocking += 1
        news = self.races[i].step(self._idle_poll_s)
        return [(i, news)] if news else []

    def wait_for_time(self) -> None:
        if self._virtual:
            self._advance_virtual_clock()
        else:
            self._woken.wait(_SCORE_WAIT_S)
            self._woken.clear()

    def _advance_virtual_clock(self) -> None:
        retired = {id(self.races[i].engine) for i in self.retired}
        times = [t for t in (s.next_event_time() for s in self._sources if id(s) not in retired) if t is not None]
        if not times:
            raise StalledError("groups are open but no simulated event is scheduled")
        self.clock.advance_to(max(self.clock.now(), min(times)))  # type: ignore[attr-defined]
