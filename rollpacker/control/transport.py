"""The control plane's ZeroMQ transport: one context, sockets that notice a peer hanging up, and
the addresses every rank publishes once.

Addresses are exchanged once over the world process group (every rank publishes host:port), so
the channels work across nodes under torchrun. Every connection lasts the whole run, so one that
closes means the process at the other end is gone: a waiting socket then raises
``PeerLostError`` at once instead of waiting on a reply that cannot come (torchrun would kill
the survivor only after its shutdown timeout, and a lone rank would wait forever).
"""
from __future__ import annotations

import os
import resource
import socket
from dataclasses import dataclass

import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from rollpacker.wakeup import Waiter

# A dead process's connections close at once. A node that drops off the network sends nothing, so
# the kernel probes an idle connection (TCP keepalive: after 10 s idle, every 5 s, 3 misses) and
# drops it within about 25 s, which the socket's monitor reports like a hang-up. Unlike ZeroMQ's
# own heartbeats, the probes never reach a process: at 512 engines those were a few hundred
# messages a second on rank 0's I/O thread.
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTVL_S, _KEEPALIVE_CNT = 10, 5, 3
_KEEPALIVE = ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, _KEEPALIVE_IDLE_S),
              (zmq.TCP_KEEPALIVE_INTVL, _KEEPALIVE_INTVL_S), (zmq.TCP_KEEPALIVE_CNT, _KEEPALIVE_CNT))
SILENT_PEER_S = _KEEPALIVE_IDLE_S + _KEEPALIVE_INTVL_S * _KEEPALIVE_CNT  # a vanished node is noticed within this

# Where each rank's sockets bind under ROLLPACKER_ZMQ_PORT (``bind``), as offsets from it.
ENGINE_SERVER_PORT, GROUP_INBOX_PORT, NEWS_INBOX_PORT, REWARD_SERVICE_PORT = 0, 64, 128, 192

_CONTEXT: zmq.Context | None = None


def context() -> zmq.Context:
    """The control plane's own ZeroMQ context. Rank 0 holds three sockets per remote engine (its
    REQ socket and its monitor's pair) and four descriptors: ZeroMQ's default of 1023 sockets per
    context, which can only be raised before a context's first socket, and a common soft limit of
    1024 open files would both stop it at a few hundred engines."""
    global _CONTEXT
    if _CONTEXT is None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        _CONTEXT = zmq.Context()
        _CONTEXT.set(zmq.MAX_SOCKETS, _CONTEXT.get(zmq.SOCKET_LIMIT))
    return _CONTEXT


class PeerLostError(ConnectionError):
    """The rank at the other end of a control-plane socket is gone."""


class Channel:
    """A ZeroMQ socket of ``kind`` that notices when a peer hangs up (its socket monitor). Its
    ``ready`` sleeps on its ``waiter``, which may watch more descriptors (an engine that rings when
    it has a completion) and, ``wakeable``, be woken by another thread."""

    def __init__(self, kind: int, peer: str, *, wakeable: bool = False):
        self.sock = context().socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        for option, value in _KEEPALIVE:
            self.sock.setsockopt(option, value)
        self.peer = peer
        self._lost: str | None = None  # the endpoint that hung up, once one has
        self._hangups = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.waiter = Waiter(self.sock, self._hangups, wakeable=wakeable)

    def ready(self, timeout_ms: int | None) -> bool:
        """Whether a message waits (within ``timeout_ms``; None: until one does, or a wake or a
        watched descriptor ends the wait). Raises ``PeerLostError`` when none does and a peer has
        hung up; one sent before that comes first."""
        events = self.waiter.wait(0 if self._lost else timeout_ms)
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
        self.waiter.close()


@dataclass(frozen=True)
class Endpoint:
    rank: int
    address: str  # tcp://host:port of the rank's EngineServer
    inbox: str  # tcp://host:port of the rank's GroupInbox


def node_address() -> str:
    """How other nodes reach this one: ``ROLLPACKER_NODE_ADDR`` where that is set (a hostname that
    resolves to another network; nodes emulated on one machine, ``tests/multinode.py``), else the
    hostname."""
    return os.environ.get("ROLLPACKER_NODE_ADDR") or socket.gethostname()


def exchange_endpoints(server_port: int, inbox_port: int, group: dist.ProcessGroup | None = None) -> list[Endpoint]:
    """Collective: every rank publishes the ports its ``EngineServer`` and ``GroupInbox`` are bound
    to. A peer on this host is reached over loopback, one on another node by its node address."""
    here = node_address()
    mine = (dist.get_rank(group), here, server_port, inbox_port)
    everyone: list[tuple | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    endpoints = []
    for rank, host, server, inbox in everyone:
        host = "127.0.0.1" if host == here else host
        endpoints.append(Endpoint(rank, f"tcp://{host}:{server}", f"tcp://{host}:{inbox}"))
    return endpoints


def bind(sock: zmq.Socket, offset: int) -> int:
    """Bind to ``ROLLPACKER_ZMQ_PORT`` + offset + local rank when that is set (fixed ports for
    firewalled clusters), else to a port the OS picks: a port derived from MASTER_PORT can
    collide with the ephemeral ports gloo's own connections use."""
    fixed = os.environ.get("ROLLPACKER_ZMQ_PORT")
    if not fixed:
        return sock.bind_to_random_port("tcp://*")
    port = int(fixed) + offset + int(os.environ.get("LOCAL_RANK", "0"))
    sock.bind(f"tcp://*:{port}")
    return port
