"""The coordinator channel: rank 0 drives rollout engines led by other ranks.

Rank 0 runs the scheduler. An engine whose leader is another rank is reached
through a ``RemoteEngine`` proxy (a ``RolloutEngine`` like any other) that
talks over ZeroMQ REQ/REP to an ``EngineServer`` on the leader. The server
keeps stepping its engine whenever it has work and answers messages between
steps, so remote engines decode concurrently with rank 0's own engine. Once
the coordinator gave it a ``Bell`` address, the server pushes each batch of
completions to rank 0 as it finishes (PUSH/PULL, one socket on rank 0 for all
engines): the coordinator neither polls engines nor waits on each in turn, and
sleeps on that one socket. Its cost follows the completions, not the number
of engines or the seconds a round lasts (``bench/bench_control.py``).

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

from rollpacker.rollout.engine import (MEMORY_TAGS, Completion, EngineStats, GenerationRequest, RequestError,
                                       RolloutEngine)
from rollpacker.wakeup import Wakeup

_STOP = "__stop_serving__"
ROUND_END = "round_end"  # why a server stops: the round is over ...
TO_TRAINING = "to_training"  # ... or its ranks were handed to the stream trainer mid-round


# A dead process's connections close at once; a node that drops off the network is noticed by
# ZeroMQ's heartbeats within the timeout.
_HEARTBEAT_IVL_MS, _HEARTBEAT_TIMEOUT_MS = 10_000, 20_000


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
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self.peer = peer
        self._lost: str | None = None  # the endpoint that hung up, once one has
        self._hangups = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._hangups, zmq.POLLIN)

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


class EngineServer:
    """Serves this rank's engine of the current round to the coordinator.

    The socket is bound once per rank; each rollout round calls ``serve``
    with the engine this rank leads in that round's layout.
    """

    def __init__(self):
        self._channel = _Channel(zmq.REP, "the coordinator (rank 0)")
        self.port = _bind(self._channel.sock, 0)
        self._done: list[Completion] = []  # finished, not yet pushed or polled
        # pushed this round, by request id: an evict still hands them back (a push may cross it)
        self._pushed: dict[str, Completion] = {}
        self._bell: zmq.Socket | None = None  # PUSH to the coordinator's Bell, once it asked for one
        self._bell_address, self._tag = "", b""

    def serve(self, engine: RolloutEngine) -> str:
        """Step ``engine`` whenever it has work, answer messages between steps, until told to
        stop; returns the reason the coordinator gave (``ROUND_END`` or ``TO_TRAINING``)."""
        while True:
            busy = bool(engine.active_request_ids())
            if self._channel.ready(0 if busy else 50) and (reason := self.answer(engine)) is not None:
                return reason
            if busy or self._done:  # _done: a push the bell's full socket refused, tried again
                self.collect(engine)

    @property
    def socket(self) -> zmq.Socket:
        """The coordinator's requests arrive here (one process may multiplex many servers)."""
        return self._channel.sock

    def answer(self, engine: RolloutEngine) -> str | None:
        """Answer the request waiting on ``socket``; the reason the coordinator gave if it was a stop."""
        method, args = self._channel.sock.recv_pyobj()
        if method == _STOP:
            self._channel.sock.send_pyobj(("ok", None))
            # whatever the round left here must not reach the next one: a request id comes back when
            # its deferred prompt is launched again, and a response sampled under older weights
            # would pass for the new one's (pushes already on their way carry the round's tag,
            # which the bell no longer accepts)
            self._tag, self._done, self._pushed = b"", [], {}
            return args[0]
        self._channel.sock.send_pyobj(self._handle(engine, method, args))
        self._push()
        return None

    def collect(self, engine: RolloutEngine) -> None:
        """Advance ``engine``; what finished goes to the coordinator's bell (or waits for its poll)."""
        self._done.extend(engine.poll(0.0))
        self._push()

    def _take(self, ids: set[str]) -> list[Completion]:
        """The finished completions of ``ids`` not yet pushed or polled, removed from the buffer."""
        taken = [c for c in self._done if c.request_id in ids]
        self._done = [c for c in self._done if c.request_id not in ids]
        return taken

    def _push(self) -> None:
        """What finished, to the bell in one message. Never blocks the engine's loop: with the
        coordinator's socket full or gone, it waits here for the next try (or a poll)."""
        if not (self._done and self._tag):
            return
        try:
            self._bell.send_multipart([self._tag, pickle.dumps(self._done, pickle.HIGHEST_PROTOCOL)],
                                      zmq.NOBLOCK)
        except zmq.Again:
            return
        self._pushed.update((c.request_id, c) for c in self._done)
        self._done = []

    def _watch(self, address: str, tag: bytes) -> None:
        if address != self._bell_address:
            if self._bell is not None:
                self._bell.close(linger=0)
            self._bell = _context().socket(zmq.PUSH)
            self._bell.setsockopt(zmq.LINGER, 0)
            self._bell.connect(address)
            self._bell_address = address
        self._tag, self._pushed = tag, {}

    def close(self) -> None:
        if self._bell is not None:
            self._bell.close(linger=0)
        self._channel.close()

    def _handle(self, engine: RolloutEngine, method: str, args: tuple) -> tuple[str, Any]:
        try:
            if method == "poll":  # what no bell took (none given yet, or its socket was full)
                out, self._done = self._done, []
                return "ok", out
            if method == "submit":  # the round's first also says where to push
                requests, watch = args
                if watch is not None:
                    self._watch(*watch)
                engine.submit(requests)
                return "ok", None
            if method == "abort":  # an aborted request is never returned, even one already finished here
                ids = set(args[0])
                self._take(ids)
                for rid in ids:
                    self._pushed.pop(rid, None)
                engine.abort(args[0])
                return "ok", None
            if method == "evict":  # finished ones are handed back too, pushed or not: a push may cross it
                ids = set(args[0])
                handed = self._take(ids) + [self._pushed.pop(rid) for rid in ids if rid in self._pushed]
                return "ok", handed + engine.evict(ids - {c.request_id for c in handed})
            return "ok", getattr(engine, method)(*args)
        except RequestError as exc:
            return "request_error", str(exc)
        except Exception as exc:  # surfaced on the coordinator, with the engine's rank
            return "error", f"{type(exc).__name__}: {exc}"


class Bell:
    """Rank 0's inbox of completions: the server of a ``RemoteEngine`` made with it pushes what its
    engine finished, tagged with the bell's round. Another thread of rank 0
    (the reward pool's, with a score) rings it with ``wake``: the coordinator then sleeps until
    something happened, never on a timer."""

    def __init__(self):
        self.sock = _context().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = _bind(self.sock, 128)
        # pushes of an earlier round (sent before its servers were stopped) are dropped: a deferred
        # prompt's request ids come back in a later round, and a stale response would pass for its own
        self.round = 0
        self.received = 0  # pushes taken, all rounds
        self._wakeup = Wakeup()
        self.woken = False  # the last ``collect`` was woken
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wakeup.fd, zmq.POLLIN)

    def new_round(self) -> None:
        """From now on only pushes tagged with the next round count (proxies tell their servers at
        their next submit)."""
        self.round += 1

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

    def collect(self, timeout_s: float = 0.0) -> list[Completion]:
        """The completions pushed this round since the last call; when none came and nothing woke
        it, waits up to ``timeout_s`` for either. ``woken`` then says whether a ``wake`` came: its
        waker left something to look at before the next wait."""
        out: list[Completion] = []
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        self.woken = self._wakeup.fd in events
        if self.woken:
            self._wakeup.drain()
        if self.sock in events:
            current = self.tag
            while True:
                try:
                    tag, payload = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.received += 1
                if tag == current:
                    out += pickle.loads(payload)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self._wakeup.close()


class RemoteEngine(RolloutEngine):
    """Proxy for an engine served by another rank's ``EngineServer``.

    With a ``bell`` its server pushes completions to the bell as they finish: ``EngineDriver`` then
    takes them from there instead of polling."""

    def __init__(self, endpoint: Endpoint, engine_id: int, timeout_s: float = 600.0, bell: Bell | None = None):
        self.endpoint, self.engine_id = endpoint, engine_id
        self._timeout_ms = int(timeout_s * 1000)
        self._channel = _Channel(zmq.REQ, f"rank {endpoint.rank}, serving engine {engine_id},")
        self._channel.sock.connect(endpoint.address)
        self.bell = bell
        self._watched: int | None = None  # the bell's round the server pushes for (told at a submit)

    def begin(self, method: str, *args: Any) -> Callable[[], Any]:
        """Send a call; the returned function waits for its reply (``scheduler.protocols.Pipelined``)."""
        if method == "submit":
            args = (*args, self._watch_once())
        elif method == _STOP:  # the server forgets the bell with the round
            self._watched = None
        self._channel.sock.send_pyobj((method, args))
        return functools.partial(self._reply, method)

    def _call(self, method: str, *args: Any) -> Any:
        return self.begin(method, *args)()

    def _watch_once(self) -> tuple[str, bytes] | None:
        """Where the server should push and with what tag, with the round's first submit."""
        if self.bell is None or self._watched == self.bell.round:
            return None
        self._watched = self.bell.round
        return self.bell.address_for(self.endpoint), self.bell.tag

    def _reply(self, method: str) -> Any:
        if not self._channel.ready(self._timeout_ms):
            raise TimeoutError(f"engine {self.engine_id} on rank {self.endpoint.rank} did not answer {method}")
        status, value = self._channel.sock.recv_pyobj()
        if status == "request_error":
            raise RequestError(value)
        if status == "error":
            raise RuntimeError(f"engine {self.engine_id} on rank {self.endpoint.rank}: {method} failed: {value}")
        return value

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._call("submit", list(requests))

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            done = self._call("poll")
            if done or time.monotonic() >= deadline:
                return done
            time.sleep(0.002)

    def abort(self, request_ids: Iterable[str]) -> None:
        self._call("abort", list(request_ids))

    def evict(self, request_ids: Iterable[str]) -> list[Completion]:
        return self._call("evict", list(request_ids))

    def active_request_ids(self) -> list[str]:
        return self._call("active_request_ids")

    def update_weights(self, named_tensors):
        raise NotImplementedError("weights reach every engine rank through the training layout's weight sync, "
                                  "not through the coordinator channel")

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._call("release_memory", list(tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._call("resume_memory", list(tags))

    def stats(self) -> EngineStats:
        return self._call("stats")

    def stop_serving(self, reason: str = ROUND_END) -> None:
        """End the server's loop: its rank returns to the SPMD program with ``reason``."""
        self._call(_STOP, reason)

    def shutdown(self) -> None:
        self._channel.close()


def stop_serving(remotes: Sequence[RemoteEngine], reason: str = ROUND_END) -> None:
    """``RemoteEngine.stop_serving`` on each, every server told before any reply is awaited."""
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
