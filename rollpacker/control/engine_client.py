"""Rank 0's side of the remote engines: a client per engine server, and the news inbox their news comes to.

An ``EngineClient`` sends typed calls (``scheduler/calls.py``) to the ``EngineServer`` of an engine
that another rank leads; ``begin`` sends one and returns what waits for its reply, so that the
driver reaches N engines in about one round trip, not N. What the servers' races have to tell
comes the other way, pushed to the round's ``NewsInbox`` (PUSH/PULL, one socket on rank 0 for all of
them), where ``control.fleet.RemoteFleet`` takes it.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

import zmq

from rollpacker.scheduler.calls import Call, Launch, Reply, RoundContext, stop_reason
from rollpacker.control.transport import NEWS_INBOX_PORT, Channel, Endpoint, bind, context, node_address
from rollpacker.rollout.engine import RequestError
from rollpacker.scheduler.clock import Clock, RealClock
from rollpacker.scheduler.group_race import RaceNews
from rollpacker.wakeup import Wakeup


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
        self._wakeup = Wakeup()
        self.woken = False  # the last ``collect`` was woken
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wakeup.fd, zmq.POLLIN)
        self._watched: list[int] = []

    def watch(self, fds: Sequence[int]) -> None:
        """A wait in ``collect`` also ends when one of ``fds`` turns readable (the ready descriptors
        of the engines rank 0 races itself); replaces the last call's."""
        for fd in self._watched:
            self._poller.unregister(fd)
        self._watched = list(fds)
        for fd in self._watched:
            self._poller.register(fd, zmq.POLLIN)

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
        self._wakeup.wake()

    def collect(self, timeout_s: float = 0.0) -> list[tuple[int, RaceNews]]:
        """The news pushed this round since the last call, as (engine index, news); when none had
        come, waits up to ``timeout_s`` for some, a ``wake`` (``woken`` then says which) or a watched
        descriptor."""
        out = self._take()
        self.woken = False
        if out or timeout_s <= 0:
            return out
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        self.woken = self._wakeup.fd in events
        if self.woken:
            self._wakeup.drain()
        return self._take() if self.sock in events else []

    def _take(self) -> list[tuple[int, RaceNews]]:
        out: list[tuple[int, RaceNews]] = []
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
        self._wakeup.close()


class EngineClient:
    """Rank 0's handle on the race that another rank's ``EngineServer`` runs for its engine
    (reached through ``control.fleet.RemoteFleet``); its news comes through ``news_inbox``."""

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
