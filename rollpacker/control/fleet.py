"""Rank 0's side of the engines that other ranks lead, and how it reaches a round's engines.

An engine that another rank leads runs its race inside that rank's ``EngineServer``
(engine_server.py). Rank 0 holds an ``EngineClient`` of it, which sends typed calls
(``scheduler/calls.py``, ZeroMQ REQ/REP); what the server's race has to tell comes the other way,
pushed to rank 0's ``NewsInbox`` (PUSH/PULL, one socket for all engines). ``ClusterFleet`` is the
``Fleet`` (``scheduler.protocols``) over those clients and rank 0's own engines, which it races in
this process through a ``LocalFleet``. A call goes to every remote engine before any reply is
awaited, so a round reaches N engines in about one round trip. With nothing new the fleet sleeps
on the news inbox until a server pushes, a score wakes it or one of rank 0's own engines has a
completion, never on a timer; a server that stays silent that long is checked for a hang-up,
since a dead rank pushes nothing.
"""
from __future__ import annotations

import pickle
import time
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlparse

import zmq

from rollpacker.control.transport import NEWS_INBOX_PORT, Channel, Endpoint, bind, context, node_address
from rollpacker.rollout.engine import RequestError, RolloutEngine
from rollpacker.scheduler.calls import Call, Launch, Reply, Retire, RoundContext, replies, stop_reason
from rollpacker.scheduler.clock import Clock, RealClock, VirtualClock
from rollpacker.scheduler.fleet import LocalFleet, News
from rollpacker.scheduler.protocols import RewardSink
from rollpacker.wakeup import Waiter

class NewsInbox:
    """Rank 0's inbox of the remote races' news: the server of each ``EngineClient`` made with it
    pushes what its race has to tell, tagged with the news inbox's round. Another thread of rank 0
    (the reward pool's, with a score) rings it with ``wake``: the coordinator then sleeps until
    something happened, never on a timer."""

    def __init__(self):
        self.sock = context().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = bind(self.sock, NEWS_INBOX_PORT)
        # pushes of an earlier round (sent before its servers were stopped) are dropped: a deferred
        # prompt's request ids come back in a later round, and a stale response would pass for its own
        self.round = 0
        self.progress = False  # this round's servers also push each response generated
        self._waiter = Waiter(self.sock)
        self._watched: list[int] = []

    @property
    def woken(self) -> bool:
        """The last ``collect`` that waited ended on a ``wake``."""
        return self._waiter.woken

    def watch(self, fds: Sequence[int]) -> None:
        """A wait in ``collect`` also ends when one of ``fds`` turns readable (the ready descriptors
        of the engines rank 0 races itself); replaces the last call's."""
        self._waiter.unwatch(*self._watched)
        self._watched = list(fds)
        self._waiter.watch(*self._watched)

    def new_round(self, progress: bool = False) -> None:
        """From now on only pushes tagged with the next round count (clients tell their servers at
        their first launch); ``progress``: the servers push each response generated too."""
        self.round += 1
        self.progress = progress

    @property
    def tag(self) -> bytes:
        """What every server sends with its pushes this round."""
        return b"%d" % self.round

    def address_for(self, endpoint: Endpoint) -> str:
        """This inbox as the server at ``endpoint`` reaches it: loopback on this host, else by this
        node's address as ``exchange_endpoints`` publishes it."""
        host = urlparse(endpoint.address).hostname
        here = "127.0.0.1" if host == "127.0.0.1" else node_address()
        return f"tcp://{here}:{self.port}"

    def wake(self) -> None:
        """Make a waiting (or the next) ``collect`` return; safe from any thread, and after ``close``."""
        self._waiter.wake()

    def collect(self, timeout_s: float = 0.0) -> News:
        """The news pushed this round since the last call, as (engine index, news); when none had
        come, waits up to ``timeout_s`` for some, a ``wake`` (``woken`` then says which) or a watched
        descriptor."""
        out = self._take()
        if out or timeout_s <= 0:
            return out
        return self._take() if self.sock in self._waiter.wait(int(timeout_s * 1000)) else []

    def _take(self) -> News:
        out: News = []
        current = self.tag
        while (message := self._receive()) is not None:
            tag, payload = message
            if tag.bytes == current:
                index, news = pickle.loads(payload.buffer)
                out += [(index, n) for n in news]
        return out

    def _receive(self) -> list[zmq.Frame] | None:
        """The next push, if one is here."""
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def close(self) -> None:
        self.sock.close(linger=0)
        self._waiter.close()


class EngineClient:
    """Rank 0's handle on the race that another rank's ``EngineServer`` runs for its engine
    (reached through ``control.fleet.ClusterFleet``); its news comes through ``news_inbox``."""

    def __init__(self, endpoint: Endpoint, engine_id: int, news_inbox: NewsInbox | None, *, clock: Clock = RealClock(),
                 timeout_s: float = 600.0):
        self.endpoint, self.engine_id, self.news_inbox, self._clock = endpoint, engine_id, news_inbox, clock
        self._timeout_ms = int(timeout_s * 1000)
        self._channel = Channel(zmq.REQ, f"rank {endpoint.rank}, serving engine {engine_id},")
        self._channel.sock.connect(endpoint.address)
        self._round: int | None = None  # the news inbox's round the server pushes for (told at a launch)
        self._inbox_address = news_inbox.address_for(endpoint) if news_inbox is not None else ""

    def begin(self, call: Call) -> Callable[[], Any]:
        """Send ``call``; the returned function waits for its reply's value."""
        if isinstance(call, Launch) and self._round != self.news_inbox.round:  # the round's first launch
            self._round = self.news_inbox.round
            call = Launch(call.groups, RoundContext(self.news_inbox.round, self.engine_id, self._inbox_address,
                                                    self.news_inbox.progress, self._clock.now()))
        elif stop_reason(call) is not None:  # the server forgets the round
            self._round = None
        self._channel.sock.send_pyobj(call)
        return lambda: self._reply(type(call).__name__)

    def call(self, call: Call) -> Any:
        """Send ``call`` and wait for its reply's value."""
        return self.begin(call)()

    def _reply(self, what: str) -> Any:
        try:  # a pipelined call's reply is often here already: no poll for it
            reply: Reply = self._channel.sock.recv_pyobj(zmq.NOBLOCK)
        except zmq.Again:
            if not self._channel.ready(self._timeout_ms):
                raise TimeoutError(f"engine {self.engine_id} on rank {self.endpoint.rank} did not answer {what}")
            reply = self._channel.sock.recv_pyobj()
        if reply.refused is not None:
            raise RequestError(reply.error, reply.refused)
        if reply.error is not None:
            raise RuntimeError(f"engine {self.engine_id} on rank {self.endpoint.rank}: {what} failed: {reply.error}")
        return reply.value

    def check_alive(self) -> None:
        """Raises ``PeerLostError`` if the server's process has hung up (no message is sent)."""
        self._channel.check_alive()

    def shutdown(self) -> None:
        self._channel.close()


# a remote engine's server is checked for a hang-up after this long without news: a dead rank
# pushes nothing, and its socket's hang-up is only seen when looked at
_LIVENESS_AFTER_S = 5.0


class ClusterFleet:
    """A round's engines across the job: this rank's own (``RolloutEngine``s, raced here and scored
    by ``reward``) and clients of the others' servers, all made with ``news_inbox``, on whose
    waiter the fleet sleeps even when every engine is its own (a score wakes it)."""

    def __init__(self, engines: Sequence[RolloutEngine | EngineClient], news_inbox: NewsInbox, clock: Clock,
                 reward: RewardSink | None, *, idle_poll_s: float = 0.005) -> None:
        if isinstance(clock, VirtualClock):
            raise TypeError("engines served by other ranks cannot tell their next event; a VirtualClock needs "
                            "simulated engines in this process")
        if any(e.news_inbox is not news_inbox for e in engines if isinstance(e, EngineClient)):
            raise ValueError("a round's remote engines must share its fleet's news inbox")
        self.clock, self.reward, self._news_inbox = clock, reward, news_inbox
        self._own_ids = [i for i, e in enumerate(engines) if isinstance(e, RolloutEngine)]  # by local index
        self._own = {i: j for j, i in enumerate(self._own_ids)}  # engine index -> index in the local fleet
        self._local = LocalFleet([engines[i] for i in self._own_ids], clock, reward, idle_poll_s=idle_poll_s,
                                 wake=news_inbox.wake)
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
        return [(self._own_ids[j], n) for j, n in news]

    def _heard(self, news: News) -> News:
        if news:
            self._last_news = time.monotonic()
        return news
