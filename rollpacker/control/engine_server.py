"""The engine server: on the rank that leads an engine, the engine's share of each round.

Rank 0 runs the scheduler. Each engine runs its share of a round as a ``GroupRace``
(scheduler/group_race.py): the prompt groups placed on it, raced and scored where the engine is.
An engine whose leader is another rank runs its race inside an ``EngineServer`` on that leader,
scored by the reward pool of the leader's node, and rank 0 holds an ``EngineClient`` that sends it
typed calls over ZeroMQ REQ/REP (``scheduler/calls.py``). The server keeps stepping its engine
whenever it has work and answers between steps, so remote engines decode concurrently with rank
0's own engine; what its race has to tell (a group complete, and in a round that may hand off,
each response generated) it pushes to rank 0's ``NewsInbox`` (PUSH/PULL, one socket on rank 0 for all
engines). So rank 0 neither polls engines nor hears of each response: its cost follows the
prompts of a round, not their responses, the engines or the seconds a round lasts
(``bench/system/control.py``).
"""
from __future__ import annotations

import pickle
import time

import zmq

from rollpacker.scheduler.calls import Call, End, Launch, Reply, Retire, RoundContext, Stats, StopReason, apply, \
    stop_reason
from rollpacker.control.transport import ENGINE_SERVER_PORT, Channel, bind, context
from rollpacker.rollout.engine import RequestError, RolloutEngine
from rollpacker.scheduler.group_race import GroupRace, RaceNews, RaceReport
from rollpacker.scheduler.protocols import RewardSink


class _AlignedClock:
    """This process's monotonic clock, shifted onto the coordinator's as its launch message read it:
    a race's times then need no translation on rank 0 (off by the message's one-way latency)."""

    def __init__(self, coordinator_now: float) -> None:
        self.offset = coordinator_now - time.monotonic()

    def now(self) -> float:
        return time.monotonic() + self.offset


class EngineServer:
    """Serves this rank's engine of the current round to the coordinator: the engine's share of
    the round runs here, as a ``GroupRace`` scored by this node's reward pool, and what it has to
    tell is pushed to the coordinator's news inbox.

    The socket is bound once per rank; each rollout round calls ``serve`` with the engine this
    rank leads in that round's layout.
    """

    def __init__(self):
        self._channel = Channel(zmq.REP, "the coordinator (rank 0)", wakeable=True)  # a score wakes it
        self.port = bind(self._channel.sock, ENGINE_SERVER_PORT)
        self._engine: RolloutEngine | None = None
        self._reward: RewardSink | None = None
        self._race: GroupRace | None = None
        self._round: RoundContext | None = None  # the round this server's race belongs to
        self._backlog: list[RaceNews] = []  # news not yet pushed (the news inbox's socket was full)
        self._outbox: zmq.Socket | None = None  # PUSH to the coordinator's NewsInbox
        self._outbox_address = ""

    def serve(self, engine: RolloutEngine, reward: RewardSink, wait_s: float = 0.005) -> StopReason:
        """Run the race the coordinator hands ``engine`` this round (scored by ``reward``), answering
        its calls between engine steps, until the race ends (``ROUND_END``) or retires to the stream
        trainer (``TO_TRAINING``). The loop sleeps until a call, a score or (an engine with a
        ``ready_fd``) a completion comes; an engine that must be polled is stepped while it
        generates, each step waiting up to ``wait_s`` for a completion (a call waits that long at
        most)."""
        self._engine, self._reward = engine, reward
        ready = engine.ready_fd()
        if ready is not None:
            self._channel.waiter.watch(ready)
        try:
            while True:
                polled = ready is None and self._race is not None and self._race.generating
                # with news the news inbox's full socket refused, try again soon
                timeout = 0 if polled else 50 if self._backlog else None
                if self._channel.ready(timeout) and (reason := self._answer()) is not None:
                    return reason
                self._advance(wait_s if polled else 0.0)
        finally:
            if ready is not None:
                self._channel.waiter.unwatch(ready)

    def _answer(self) -> StopReason | None:
        """Answer the call waiting on the socket; why serving ends, if it does."""
        call: Call = self._channel.sock.recv_pyobj()
        reply = self._handle(call)
        self._channel.sock.send_pyobj(reply)
        reason = stop_reason(call)
        if reason is not None and reply.error is None:
            # whatever the round left here must not reach the next one: a request id comes back when
            # its deferred prompt is launched again (pushes already on their way carry the round's
            # tag, which the news inbox no longer accepts)
            self._race, self._round, self._backlog = None, None, []
            return reason
        self._push()
        return None

    def _advance(self, wait_s: float = 0.0) -> None:
        """Step the race (the engine may wait up to ``wait_s`` for a completion); what it has to
        tell goes to the coordinator's news inbox."""
        if self._race is not None:
            news = self._race.step(wait_s)
            if news.done or news.moved or (self._round.progress and news.finished):
                self._backlog.append(news)
        self._push()

    def _push(self) -> None:
        """The news, to the news inbox in one message. Never blocks the engine's loop: with the
        coordinator's socket full it waits here for the next try."""
        if not (self._backlog and self._round):
            return
        payload = pickle.dumps((self._round.engine, self._backlog), pickle.HIGHEST_PROTOCOL)
        try:
            self._outbox.send_multipart([self._round.tag, payload], zmq.NOBLOCK)
        except zmq.Again:
            return
        self._backlog = []

    def _begin_round(self, round_: RoundContext) -> None:
        if round_.inbox_address != self._outbox_address:
            if self._outbox is not None:
                self._outbox.close(linger=0)
            self._outbox = context().socket(zmq.PUSH)
            self._outbox.setsockopt(zmq.LINGER, 0)
            self._outbox.connect(round_.inbox_address)
            self._outbox_address = round_.inbox_address
        self._round, self._backlog = round_, []
        self._race = GroupRace(self._engine, self._reward, _AlignedClock(round_.coordinator_now), wake=self._wake)

    def _wake(self) -> None:
        """A score came for the race (from the reward pool's thread)."""
        self._channel.waiter.wake()

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.close(linger=0)
        self._channel.close()

    def _handle(self, call: Call) -> Reply:
        try:
            if isinstance(call, Launch) and call.round is not None:
                self._begin_round(call.round)
            if self._race is None:  # a server that got no group this round has nothing to tell
                if isinstance(call, End):
                    return Reply(RaceReport())
                if isinstance(call, Retire):
                    return Reply(([], RaceReport(undelivered=self._backlog)))
                if isinstance(call, Stats):
                    return Reply(self._engine.stats())
            value = apply(self._race, call)
            if isinstance(call, Retire):  # its groups go back, with the news the news inbox could not take
                value[1].undelivered = self._backlog
            return Reply(value)
        except RequestError as exc:
            return Reply(error=str(exc), refused=exc.request_ids)
        except Exception as exc:  # surfaced on the coordinator, with the engine's rank
            return Reply(error=f"{type(exc).__name__}: {exc}")
