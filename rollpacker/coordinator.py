"""The coordinator channel: rank 0 drives rollout engines led by other ranks.

Rank 0 runs the scheduler. Each engine runs its share of a round as a ``GroupRace``
(scheduler/group_race.py): the prompt groups placed on it, raced and scored where the engine is.
An engine whose leader is another rank runs its race inside an ``EngineServer`` on that leader,
scored by the reward pool of the leader's node, and rank 0 holds a ``RemoteRace`` handle that
talks ZeroMQ REQ/REP to it: a launch of the groups placed there, the end of the round, a
hand-off's retire, stats. The server keeps stepping its engine whenever it has work and answers
between steps, so remote engines decode concurrently with rank 0's own engine; what its race has
to tell (a group complete, and in a round that may hand off, each response generated) it pushes
to rank 0's ``Bell`` (PUSH/PULL, one socket on rank 0 for all engines). So rank 0 neither polls
engines nor hears of each response: its cost follows the prompts of a round, not their responses,
the engines or the seconds a round lasts (``bench/bench_control.py``).

In long rounds the coordinator also feeds finished prompt groups to ranks
handed to the stream trainer (``GroupFeed`` → ``GroupInbox``, PUSH/PULL).

Addresses are exchanged once over the world process group (every rank
publishes host:port), so the channel works across nodes under torchrun.

Every connection lasts the whole run, so one that closes means the process at
the other end is gone: a waiting socket then raises ``PeerLostError`` at once
instead of waiting on a reply that cannot come (torchrun would kill the
survivor only after its shutdown timeout, and a lone rank would wait forever).
"""
from __future__ import annotations

import functools
import os
import pickle
import resource
import socket
import time
from urllib.parse import urlparse
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from rollpacker.rollout.engine import EngineStats, RequestError, RolloutEngine
from rollpacker.scheduler.clock import Clock, RealClock
from rollpacker.scheduler.group_race import GroupLaunch, GroupRace, RaceNews, RaceReport
from rollpacker.scheduler.protocols import RewardSink
from rollpacker.wakeup import Wakeup

_STOP = "__stop_serving__"
ROUND_END = "round_end"  # why a server stops: the round is over ...
TO_TRAINING = "to_training"  # ... or its ranks were handed to the stream trainer mid-round


# A dead process's connections close at once. A node that drops off the network sends nothing, so
# the kernel probes an idle connection (TCP keepalive: after 10 s idle, every 5 s, 3 misses) and
# drops it within about 25 s, which the socket's monitor reports like a hang-up. Unlike ZeroMQ's
# own heartbeats, the probes never reach a process: at 512 engines those were a few hundred
# messages a second on rank 0's I/O thread.
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTVL_S, _KEEPALIVE_CNT = 10, 5, 3
_KEEPALIVE = ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, _KEEPALIVE_IDLE_S),
              (zmq.TCP_KEEPALIVE_INTVL, _KEEPALIVE_INTVL_S), (zmq.TCP_KEEPALIVE_CNT, _KEEPALIVE_CNT))
SILENT_PEER_S = _KEEPALIVE_IDLE_S + _KEEPALIVE_INTVL_S * _KEEPALIVE_CNT  # a vanished node is noticed within this


_CONTEXT: zmq.Context | None = None


def _context() -> zmq.Context:
    """The channel's own ZeroMQ context. Rank 0 holds three sockets per remote engine (its REQ socket
    and its monitor's pair) and four descriptors: ZeroMQ's default of 1023 sockets per context, which
    can only be raised before a context's first socket, and a common soft limit of 1024 open files
    would both stop it at a few hundred engines."""
    global _CONTEXT
    if _CONTEXT is None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        _CONTEXT = zmq.Context()
        _CONTEXT.set(zmq.MAX_SOCKETS, _CONTEXT.get(zmq.SOCKET_LIMIT))
    return _CONTEXT


class PeerLostError(ConnectionError):
    """The rank at the other end of a coordinator socket is gone."""


class _Channel:
    """A ZeroMQ socket of ``kind`` that notices when a peer hangs up (its socket monitor)."""

    def __init__(self, kind: int, peer: str):
        self.sock = _context().socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        for option, value in _KEEPALIVE:
            self.sock.setsockopt(option, value)
        self.peer = peer
        self._lost: str | None = None  # the endpoint that hung up, once one has
        self._hangups = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._hangups, zmq.POLLIN)

    def also_wake_on(self, fd: int) -> None:
        """``ready`` also returns (False) when ``fd`` turns readable: a waiter's other news."""
        self._poller.register(fd, zmq.POLLIN)

    def stop_waking_on(self, fd: int) -> None:
        self._poller.unregister(fd)

    def ready(self, timeout_ms: int | None) -> bool:
        """Whether a message waits (within ``timeout_ms``; None: until one does). Raises
        ``PeerLostError`` when none does and a peer has hung up; one sent before that comes first."""
        events = dict(self._poller.poll(0 if self._lost else timeout_ms))
        if self.sock in events:
            return True
        if self._hangups in events:
            self._lost = recv_monitor_message(self._hangups)["endpoint"].decode()
        if self._lost:
            raise PeerLostError(f"{self.peer} hung up ({self._lost}): its process died or its node left the job")
        return False

    def check_alive(self) -> None:
        """Raises ``PeerLostError`` if a peer has hung up; reads no message."""
        if not self._lost and self._hangups.poll(0):
            self._lost = recv_monitor_message(self._hangups)["endpoint"].decode()
        if self._lost:
            raise PeerLostError(f"{self.peer} hung up ({self._lost}): its process died or its node left the job")

    def close(self) -> None:
        self.sock.disable_monitor()
        self._hangups.close(linger=0)
        self.sock.close(linger=0)


@dataclass(frozen=True)
class Endpoint:
    rank: int
    address: str  # tcp://host:port of the rank's EngineServer
    inbox: str  # tcp://host:port of the rank's GroupInbox


def exchange_endpoints(server_port: int, inbox_port: int, group: dist.ProcessGroup | None = None) -> list[Endpoint]:
    """Collective: every rank publishes the ports its ``EngineServer`` and ``GroupInbox`` are bound to.

    A peer on this host is reached over loopback, one on another node by its
    hostname, or by the address ``ROLLPACKER_NODE_ADDR`` gives where that is set (a hostname that
    resolves to another network; nodes emulated on one machine, ``tests/multinode.py``).
    """
    here = os.environ.get("ROLLPACKER_NODE_ADDR") or socket.gethostname()
    mine = (dist.get_rank(group), here, server_port, inbox_port)
    everyone: list[tuple | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    endpoints = []
    for rank, host, server, inbox in everyone:
        host = "127.0.0.1" if host == here else host
        endpoints.append(Endpoint(rank, f"tcp://{host}:{server}", f"tcp://{host}:{inbox}"))
    return endpoints


def _bind(sock: zmq.Socket, offset: int) -> int:
    """Bind to ``ROLLPACKER_ZMQ_PORT`` + offset + local rank when that is set (fixed ports for
    firewalled clusters), else to a port the OS picks: a port derived from MASTER_PORT can
    collide with the ephemeral ports gloo's own connections use."""
    fixed = os.environ.get("ROLLPACKER_ZMQ_PORT")
    if not fixed:
        return sock.bind_to_random_port("tcp://*")
    port = int(fixed) + offset + int(os.environ.get("LOCAL_RANK", "0"))
    sock.bind(f"tcp://*:{port}")
    return port


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
    tell is pushed to the coordinator's bell.

    The socket is bound once per rank; each rollout round calls ``serve`` with the engine this
    rank leads in that round's layout. ``wakeup``: what a score wakes (one may serve many
    servers multiplexed in one process); by default the server's own.
    """

    def __init__(self, wakeup: Wakeup | None = None):
        self._channel = _Channel(zmq.REP, "the coordinator (rank 0)")
        self.port = _bind(self._channel.sock, 0)
        self._own_wakeup = wakeup is None
        self.wakeup = Wakeup() if wakeup is None else wakeup
        self._channel.also_wake_on(self.wakeup.fd)
        self._engine: RolloutEngine | None = None
        self._reward: RewardSink | None = None
        self._race: GroupRace | None = None
        self._backlog: list[RaceNews] = []  # news not yet pushed (the bell's socket was full)
        self._bell: zmq.Socket | None = None  # PUSH to the coordinator's Bell
        self._bell_address, self._tag, self._index, self._progress = "", b"", 0, False

    def serve(self, engine: RolloutEngine, reward: RewardSink, wait_s: float = 0.005) -> str:
        """Run the race the coordinator hands ``engine`` this round (scored by ``reward``), answering
        its messages between engine steps, until the race ends (``ROUND_END``), retires to the stream
        trainer (``TO_TRAINING``) or the coordinator stops the server without one. The loop sleeps until a message, a score or (an engine
        with a ``ready_fd``) a completion comes; an engine that must be polled is stepped while it
        generates, each step waiting up to ``wait_s`` for a completion (a message waits that long
        at most)."""
        self.bind(engine, reward)
        ready = engine.ready_fd()
        if ready is not None:
            self._channel.also_wake_on(ready)
        try:
            while True:
                polled = ready is None and self._race is not None and self._race.generating
                # with news the bell's full socket refused, try again soon
                timeout = 0 if polled else 50 if self._backlog else None
                if self._channel.ready(timeout) and (reason := self.answer()) is not None:
                    return reason
                self.advance(wait_s if polled else 0.0)
        finally:
            if ready is not None:
                self._channel.stop_waking_on(ready)

    def bind(self, engine: RolloutEngine, reward: RewardSink) -> None:
        """The engine (and its reward sink) the next messages are about."""
        self._engine, self._reward = engine, reward

    @property
    def socket(self) -> zmq.Socket:
        """The coordinator's requests arrive here (one process may multiplex many servers)."""
        return self._channel.sock

    def answer(self) -> str | None:
        """Answer the request waiting on ``socket``; why serving ends, if it does: the race's end
        (``ROUND_END``), its retire (``TO_TRAINING``) or a stop with its reason."""
        method, args = self._channel.sock.recv_pyobj()
        reply = ("ok", None) if method == _STOP else self._handle(method, args)
        self._channel.sock.send_pyobj(reply)
        ends = {_STOP: args[0] if args else ROUND_END, "end": ROUND_END, "retire": TO_TRAINING}.get(method)
        if ends is not None and reply[0] == "ok":
            # whatever the round left here must not reach the next one: a request id comes back when
            # its deferred prompt is launched again (pushes already on their way carry the round's
            # tag, which the bell no longer accepts)
            self._race, self._tag, self._backlog = None, b"", []
            return ends
        self._push()
        return None

    def advance(self, wait_s: float = 0.0) -> None:
        """Step the race (the engine may wait up to ``wait_s`` for a completion); what it has to
        tell goes to the coordinator's bell."""
        if self._own_wakeup:
            self.wakeup.drain()  # before the race looks at the scores its wakers handed over
        if self._race is not None:
            news = self._race.step(wait_s)
            if news.done or (self._progress and news.finished):
                self._backlog.append(news)
        self._push()

    def _push(self) -> None:
        """The news, to the bell in one message. Never blocks the engine's loop: with the
        coordinator's socket full it waits here for the next try."""
        if not (self._backlog and self._tag):
            return
        try:
            self._bell.send_multipart([self._tag, pickle.dumps((self._index, self._backlog), pickle.HIGHEST_PROTOCOL)],
                                      zmq.NOBLOCK)
        except zmq.Again:
            return
        self._backlog = []

    def _begin_round(self, address: str, tag: bytes, index: int, progress: bool, coordinator_now: float) -> None:
        if address != self._bell_address:
            if self._bell is not None:
                self._bell.close(linger=0)
            self._bell = _context().socket(zmq.PUSH)
            self._bell.setsockopt(zmq.LINGER, 0)
            self._bell.connect(address)
            self._bell_address = address
        self._tag, self._index, self._progress, self._backlog = tag, index, progress, []
        self._race = GroupRace(self._engine, self._reward, _AlignedClock(coordinator_now), wake=self.wakeup.wake)

    def close(self) -> None:
        if self._bell is not None:
            self._bell.close(linger=0)
        if self._own_wakeup:
            self.wakeup.close()
        self._channel.close()

    def _handle(self, method: str, args: tuple) -> tuple[str, Any]:
        try:
            if method == "launch":  # a round's first also says where to push, and the coordinator's time
                groups, round_ = args
                if round_ is not None:
                    self._begin_round(*round_)
                self._race.launch(groups)
                return "ok", None
            if method == "end":  # a server that got no group this round has nothing to tell
                return "ok", self._race.end() if self._race is not None else RaceReport()
            if method == "retire":  # its groups go back, with the news the bell could not take
                states, report = self._race.retire() if self._race is not None else ([], RaceReport())
                report.undelivered = self._backlog
                return "ok", (states, report)
            if method == "stats":
                return "ok", self._engine.stats()
            raise ValueError(f"unknown method {method!r}")
        except RequestError as exc:
            return "request_error", (str(exc), exc.request_ids)
        except Exception as exc:  # surfaced on the coordinator, with the engine's rank
            return "error", f"{type(exc).__name__}: {exc}"


class Bell:
    """Rank 0's inbox of the remote races' news: the server of each ``RemoteRace`` made with it
    pushes what its race has to tell, tagged with the bell's round. Another thread of rank 0
    (the reward pool's, with a score) rings it with ``wake``: the coordinator then sleeps until
    something happened, never on a timer."""

    def __init__(self):
        self.sock = _context().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = _bind(self.sock, 128)
        # pushes of an earlier round (sent before its servers were stopped) are dropped: a deferred
        # prompt's request ids come back in a later round, and a stale response would pass for its own
        self.round = 0
        self.progress = False  # this round's servers also push each response generated
        self.received = 0  # pushes taken, all rounds
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
        """From now on only pushes tagged with the next round count (proxies tell their servers at
        their first launch); ``progress``: the servers push each response generated too."""
        self.round += 1
        self.progress = progress

    @property
    def tag(self) -> bytes:
        """What every server sends with its pushes this round."""
        return b"%d" % self.round

    def address_for(self, endpoint: Endpoint) -> str:
        """This bell as the server at ``endpoint`` reaches it: loopback on this host, else by this
        node's address as ``exchange_endpoints`` publishes it."""
        host = urlparse(endpoint.address).hostname
        here = "127.0.0.1" if host == "127.0.0.1" else os.environ.get("ROLLPACKER_NODE_ADDR") or socket.gethostname()
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
        while True:
            try:
                tag, payload = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            self.received += 1
            if tag.bytes == current:
                index, news = pickle.loads(payload.buffer)
                out += [(index, n) for n in news]

    def close(self) -> None:
        self.sock.close(linger=0)
        self._wakeup.close()


class RemoteRace:
    """Rank 0's handle on the race that another rank's ``EngineServer`` runs for its engine; its
    news comes through ``bell`` (``EngineDriver`` takes it there)."""

    def __init__(self, endpoint: Endpoint, engine_id: int, bell: Bell, *, clock: Clock = RealClock(),
                 timeout_s: float = 600.0):
        self.endpoint, self.engine_id, self.bell, self._clock = endpoint, engine_id, bell, clock
        self._timeout_ms = int(timeout_s * 1000)
        self._channel = _Channel(zmq.REQ, f"rank {endpoint.rank}, serving engine {engine_id},")
        self._channel.sock.connect(endpoint.address)
        self._round: int | None = None  # the bell's round the server pushes for (told at a launch)
        self._bell_address = bell.address_for(endpoint) if bell is not None else ""

    def begin(self, method: str, *args: Any) -> Callable[[], Any]:
        """Send a call; the returned function waits for its reply (``scheduler.protocols.RemoteRace``)."""
        if method == "launch":
            args = (*args, self._round_once())
        elif method == _STOP:  # the server forgets the round
            self._round = None
        self._channel.sock.send_pyobj((method, args))
        return functools.partial(self._reply, method)

    def _call(self, method: str, *args: Any) -> Any:
        return self.begin(method, *args)()

    def _round_once(self) -> tuple | None:
        """Where the server should push, with what tag, as which engine, whether it pushes every
        response generated, and this clock's time: with the round's first launch."""
        if self._round == self.bell.round:
            return None
        self._round = self.bell.round
        return self._bell_address, self.bell.tag, self.engine_id, self.bell.progress, self._clock.now()

    def _reply(self, method: str) -> Any:
        try:  # a pipelined call's reply is often here already: no poll for it
            status, value = self._channel.sock.recv_pyobj(zmq.NOBLOCK)
        except zmq.Again:
            if not self._channel.ready(self._timeout_ms):
                raise TimeoutError(f"engine {self.engine_id} on rank {self.endpoint.rank} did not answer {method}")
            status, value = self._channel.sock.recv_pyobj()
        if status == "request_error":
            raise RequestError(*value)
        if status == "error":
            raise RuntimeError(f"engine {self.engine_id} on rank {self.endpoint.rank}: {method} failed: {value}")
        return value

    def launch(self, groups: Sequence[GroupLaunch]) -> None:
        self._call("launch", list(groups))

    def end(self) -> RaceReport:
        """The round is over: the server ends its race, reports it and stops serving (``ROUND_END``)."""
        self._round = None
        return self._call("end")

    def retire(self) -> tuple[list[GroupLaunch], RaceReport]:
        """The engine goes to the stream trainer: its open groups come back, its server stops serving
        (``TO_TRAINING``)."""
        self._round = None
        return self._call("retire")

    def stats(self) -> EngineStats:
        return self._call("stats")

    def check_alive(self) -> None:
        """Raises ``PeerLostError`` if the server's process has hung up (no message is sent)."""
        self._channel.check_alive()

    def stop_serving(self, reason: str = ROUND_END) -> None:
        """End the server's loop without a race to end: its rank returns to the SPMD program with ``reason``."""
        self._call(_STOP, reason)

    def shutdown(self) -> None:
        self._channel.close()


def stop_serving(remotes: Sequence[RemoteRace], reason: str = ROUND_END) -> None:
    """``RemoteRace.stop_serving`` on each, every server told before any reply is awaited."""
    for reply in [remote.begin(_STOP, reason) for remote in remotes]:
        reply()


class GroupInbox:
    """A rank's end of the stream-trainer feed: prompt groups pushed by the coordinator."""

    def __init__(self):
        self._channel = _Channel(zmq.PULL, "the coordinator (rank 0), feeding this rank's stream trainer,")
        self.port = _bind(self._channel.sock, 64)

    def receive(self) -> Any:
        """The next message on a rank handed to training: a finished prompt group, or the end of the
        round's rollout (``streaming.RolloutEnded``)."""
        self._channel.ready(None)
        return self._channel.sock.recv_pyobj()

    def wait(self, timeout_s: float) -> bool:
        """Whether a message arrives within ``timeout_s``."""
        return bool(self._channel.sock.poll(int(timeout_s * 1000)))

    def drain(self) -> list[Any]:
        """Every message already here, without waiting."""
        out = []
        while self._channel.sock.poll(0):
            out.append(self._channel.sock.recv_pyobj())
        return out

    def close(self) -> None:
        self._channel.close()


class GroupFeed:
    """The coordinator's end: pushes finished groups to ranks that stream-train (they push
    their acknowledgements back to rank 0's inbox the same way).

    PUSH/PULL keeps rank 0 from waiting on a trainer's forward/backward: a
    group is queued on the socket and the scheduler goes on at once.
    """

    def __init__(self, endpoints: Sequence[Endpoint]):
        self._endpoints = endpoints
        self._socks: dict[int, zmq.Socket] = {}

    def send(self, ranks: Iterable[int], group: Any) -> None:
        """``group`` to each of ``ranks`` (one data-parallel replica); ``streaming.RolloutEnded`` ends their round."""
        for rank in ranks:
            if rank not in self._socks:
                sock = _context().socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(self._endpoints[rank].inbox)
                self._socks[rank] = sock
            self._socks[rank].send_pyobj(group)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
