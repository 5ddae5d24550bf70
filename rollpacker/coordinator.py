"""The coordinator channel: rank 0 drives rollout engines led by other ranks.

Rank 0 runs the scheduler. An engine whose leader is another rank is reached
through a ``RemoteEngine`` proxy (a ``RolloutEngine`` like any other) that
talks over ZeroMQ REQ/REP to an ``EngineServer`` on the leader. The server
keeps stepping its engine whenever it has work and answers messages between
steps, so remote engines decode concurrently with rank 0's own engine; a
``poll`` from the coordinator only collects completions already buffered.

Addresses are exchanged once over the world process group (every rank
publishes host:port), so the channel works across nodes under torchrun.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch.distributed as dist
import zmq

from rollpacker.rollout.engine import (MEMORY_TAGS, Completion, EngineStats, GenerationRequest, RequestError,
                                       RolloutEngine)

_STOP = "__stop_serving__"


@dataclass(frozen=True)
class Endpoint:
    rank: int
    address: str  # tcp://host:port


def exchange_endpoints(group: dist.ProcessGroup | None = None) -> list[Endpoint]:
    """Collective: every rank learns every rank's server address.

    Ports are ``ROLLPACKER_ZMQ_PORT`` (default MASTER_PORT + 101) plus the local
    rank, so ranks on one node never collide; a peer on this host is reached
    over loopback, one on another node by its hostname.
    """
    base = int(os.environ.get("ROLLPACKER_ZMQ_PORT", int(os.environ.get("MASTER_PORT", "29500")) + 101))
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank(group)))
    mine = (dist.get_rank(group), socket.gethostname(), base + local_rank)
    everyone: list[tuple | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    here = socket.gethostname()
    return [Endpoint(r, f"tcp://{'127.0.0.1' if h == here else h}:{port}") for r, h, port in everyone]


class EngineServer:
    """Serves this rank's engine of the current round to the coordinator.

    The socket is bound once per rank; each rollout round calls ``serve``
    with the engine this rank leads in that round's layout.
    """

    def __init__(self, address: str):
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.bind(f"tcp://*:{address.rsplit(':', 1)[1]}")
        self._done: list[Completion] = []

    def serve(self, engine: RolloutEngine) -> None:
        """Step ``engine`` whenever it has work, answer messages between steps, until told to stop."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while True:
            busy = bool(engine.active_request_ids())
            if poller.poll(0 if busy else 50):
                method, args = self._sock.recv_pyobj()
                if method == _STOP:
                    self._sock.send_pyobj(("ok", None))
                    return
                self._sock.send_pyobj(self._handle(engine, method, args))
            if busy:
                self._done.extend(engine.poll(0.0))

    def close(self) -> None:
        self._sock.close(linger=0)

    def _handle(self, engine: RolloutEngine, method: str, args: tuple) -> tuple[str, Any]:
        try:
            if method == "poll":
                out, self._done = self._done, []
                return "ok", out
            return "ok", getattr(engine, method)(*args)
        except RequestError as exc:
            return "request_error", str(exc)
        except Exception as exc:  # surfaced on the coordinator, with the engine's rank
            return "error", f"{type(exc).__name__}: {exc}"


class RemoteEngine(RolloutEngine):
    """Proxy for an engine served by another rank's ``EngineServer``."""

    def __init__(self, endpoint: Endpoint, engine_id: int, timeout_s: float = 600.0):
        self.endpoint, self.engine_id = endpoint, engine_id
        self._sock = zmq.Context.instance().socket(zmq.REQ)
        self._sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint.address)

    def _call(self, method: str, *args: Any) -> Any:
        self._sock.send_pyobj((method, args))
        try:
            status, value = self._sock.recv_pyobj()
        except zmq.Again:
            raise TimeoutError(f"engine {self.engine_id} on rank {self.endpoint.rank} did not answer {method}") from None
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

    def stop_serving(self) -> None:
        """End the server's loop: its rank returns to the SPMD program."""
        self._call(_STOP)

    def shutdown(self) -> None:
        self._sock.close(linger=0)
