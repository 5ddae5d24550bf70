"""How rank 0 reaches a round's engines when other ranks lead some of them: ``RemoteFleet``.

An engine that another rank leads runs its race inside that rank's ``EngineServer``; rank 0 holds
an ``EngineClient`` of it, and the server pushes the race's news to the ``NewsInbox`` that the round's
remote engines share. Rank 0's own engines are raced here through a ``LocalFleet``. A call goes to
every remote engine before any reply is awaited, so a round reaches N engines in about one round
trip. With nothing new the fleet sleeps on the news inbox until a server pushes, a score wakes it or one
of rank 0's own engines has a completion, never on a timer; a server that stays silent that long
is checked for a hang-up, since a dead rank pushes nothing.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from rollpacker.control.engine_client import NewsInbox, EngineClient
from rollpacker.rollout.engine import RolloutEngine
from rollpacker.scheduler.calls import Call, Retire, replies
from rollpacker.scheduler.clock import Clock, VirtualClock
from rollpacker.scheduler.fleet import LocalFleet, News
from rollpacker.scheduler.protocols import RewardSink

# a remote engine's server is checked for a hang-up after this long without news: a dead rank
# pushes nothing, and its socket's hang-up is only seen when looked at
_LIVENESS_AFTER_S = 5.0


class RemoteFleet:
    """``engines``: this rank's own (``RolloutEngine``s, raced here and scored by ``reward``) and
    clients of the others' servers, all made with ``news_inbox``."""

    def __init__(self, engines: Sequence[RolloutEngine | EngineClient], news_inbox: NewsInbox, clock: Clock,
                 reward: RewardSink | None, *, idle_poll_s: float = 0.005) -> None:
        if isinstance(clock, VirtualClock):
            raise TypeError("engines served by other ranks cannot tell their next event; a VirtualClock needs "
                            "simulated engines in this process")
        if any(e.news_inbox is not news_inbox for e in engines if isinstance(e, EngineClient)):
            raise ValueError("a round's remote engines must share its fleet's news inbox")
        self.clock, self.reward, self._news_inbox = clock, reward, news_inbox
        own = [i for i, e in enumerate(engines) if isinstance(e, RolloutEngine)]
        self._own = dict(zip(own, range(len(own))))  # engine index -> index in the local fleet
        self._local = LocalFleet([engines[i] for i in own], clock, reward, idle_poll_s=idle_poll_s, wake=news_inbox.wake)
        self._clients = {i: e for i, e in enumerate(engines) if i not in self._own}
        self._size = len(engines)
        # own engines that tell when they have a completion: a wait sleeps on them with the news inbox
        self._ringing = {j for j, race in enumerate(self._local.races) if race.engine.ready_fd() is not None}
        self._retired: set[int] = set()  # remote engines handed to training: no longer checked on
        self._last_news = time.monotonic()

    @property
    def size(self) -> int:
        return self._size

    def wake(self) -> None:
        self._news_inbox.wake()

    def open_round(self, progress: bool) -> None:
        """What the news inbox still gets from an earlier round is stale from now on."""
        self._news_inbox.new_round(progress)
        self._news_inbox.watch([self._local.races[j].engine.ready_fd() for j in self._ringing])

    def close_round(self) -> None:
        self._news_inbox.watch([])

    def call(self, calls: Iterable[tuple[int, Call]]) -> list:
        return replies(self._begin(i, call) for i, call in calls)

    def poll(self, wait: bool = False) -> News:
        news = self._from_local(self._local.poll())
        return self._heard(news + self._news_inbox.collect() if news or not wait else self._wait())

    def _wait(self) -> News:
        """Block on one of rank 0's own engines that must be polled for its work, else sleep on the
        news inbox (a score that came since the races looked left it readable: no sleep then)."""
        local = self._local.block_on_one(j for j in range(self._local.size) if j not in self._ringing)
        if local is not None:
            return self._from_local(local) + self._news_inbox.collect()
        news = self._news_inbox.collect(max(0.001, self._last_news + _LIVENESS_AFTER_S - time.monotonic()))
        if not news and not self._news_inbox.woken and time.monotonic() - self._last_news >= _LIVENESS_AFTER_S:
            for i, client in self._clients.items():
                if i not in self._retired:
                    client.check_alive()
            self._last_news = time.monotonic()
        return news

    def wait_for_time(self) -> None:
        self._news_inbox.collect(_LIVENESS_AFTER_S)

    def _begin(self, i: int, call: Call) -> Callable[[], object]:
        if i in self._own:
            return self._local.begin(self._own[i], call)
        if isinstance(call, Retire):
            self._retired.add(i)
        return self._clients[i].begin(call)

    def _from_local(self, news: News) -> News:
        index = list(self._own)
        return [(index[j], n) for j, n in news]

    def _heard(self, news: News) -> News:
        if news:
            self._last_news = time.monotonic()
        return news


def fleet_of(engines: Sequence[RolloutEngine | EngineClient], news_inbox: NewsInbox, clock: Clock, reward: RewardSink | None, *,
             idle_poll_s: float = 0.005) -> LocalFleet | RemoteFleet:
    """The fleet that reaches ``engines``: a ``LocalFleet`` when every one is in this process."""
    if all(isinstance(e, RolloutEngine) for e in engines):
        return LocalFleet(engines, clock, reward, idle_poll_s=idle_poll_s)
    return RemoteFleet(engines, news_inbox, clock, reward, idle_poll_s=idle_poll_s)
