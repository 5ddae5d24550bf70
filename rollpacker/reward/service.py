"""A node's reward pool, shared by every rank of the node.

Responses are scored where they are generated: each engine's race (scheduler/group_race.py)
submits its finished responses to the pool of its own node, so scoring capacity grows with the
nodes and rank 0 never sees a response that its group does not need. A node has one pool, in its
first rank's process (``reward.num_workers`` workers: a node's CPUs, shared by its engines, and
each code test's sandbox uid unique on the node); the node's other ranks reach it over loopback
ZeroMQ: a ``RewardService`` thread beside the pool answers their ``RemoteRewardSink``s.

Each side has one thread that owns its socket (ZeroMQ sockets are not thread-safe) and wakes on
the socket or on work handed over in memory (a ``Waiter``): submitted jobs on the sink's side,
scores on the service's. Jobs and scores cross in batches, one message per wake-up. A score's
future tells its waiter from the sink's thread (``add_done_callback``), as the pool's own futures
do from its dispatcher.
"""
from __future__ import annotations

import array
import collections
import functools
import itertools
import logging
import pickle
import threading
from concurrent.futures import Future
from typing import Any

import zmq

from rollpacker.control.transport import REWARD_SERVICE_PORT, PeerLostError, bind, context
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.pool import RewardPool
from rollpacker.reward.sink import PoolRewardSink
from rollpacker.sample import Sample
from rollpacker.scheduler.protocols import RewardSink
from rollpacker.wakeup import Waiter

log = logging.getLogger(__name__)


class RewardService:
    """Serves ``pool`` to the node's other ranks until ``close``."""

    def __init__(self, pool: RewardPool):
        self._pool = pool
        self._sock = context().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = bind(self._sock, REWARD_SERVICE_PORT)
        self._scores: collections.deque[tuple[bytes, int, Any, str | None]] = collections.deque()
        self._waiter = Waiter(self._sock)  # a request, or a score (or the close) handed over
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="reward-service", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing = True
        self._waiter.wake()
        self._thread.join()
        self._sock.close(linger=0)
        self._waiter.close()

    def _serve(self) -> None:
        while not self._closing:
            events = self._waiter.wait()
            while self._sock in events:
                try:
                    sender, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for job_id, data_source, response, label, key, adapt in pickle.loads(payload):
                    try:
                        future = self._pool.submit(data_source, response, label, key=key, adapt=adapt)
                    except Exception as exc:  # noqa: BLE001 - the submitter's error, raised on its side
                        self._scores.append((sender, job_id, None, f"{type(exc).__name__}: {exc}"))
                        continue
                    future.add_done_callback(functools.partial(self._scored, sender, job_id))
            self._send_scores()

    def _scored(self, sender: bytes, job_id: int, future: Future) -> None:
        """From the pool's dispatcher thread."""
        self._scores.append((sender, job_id, future.result(), None))
        self._waiter.wake()

    def _send_scores(self) -> None:
        by_sender: dict[bytes, list[tuple[int, Any, str | None]]] = collections.defaultdict(list)
        while self._scores:
            sender, job_id, score, error = self._scores.popleft()
            by_sender[sender].append((job_id, score, error))
        for sender, scores in by_sender.items():
            self._sock.send_multipart([sender, pickle.dumps(scores, pickle.HIGHEST_PROTOCOL)])


class RemoteRewardSink:
    """A ``RewardSink`` whose responses are scored by the node's pool in another rank's process
    (the ``RewardService`` at ``address``). A service that goes away fails every score still
    awaited with ``PeerLostError``."""

    def __init__(self, address: str):
        self._sock = context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._hangups = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self.address = address
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._outbox: collections.deque[tuple] = collections.deque()
        self._lock = threading.Lock()  # a submit and the sink's thread failing every pending future
        self._lost: str | None = None
        self._waiter = Waiter(self._sock, self._hangups)  # a score, a hang-up, or a job (or the close) handed over
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="reward-sink", daemon=True)
        self._thread.start()

    def submit(self, sample: Sample, *, key: str | None = None, adapt: bool = True) -> Future:
        p, future = sample.prompt, Future()
        response = sample.response_ids
        if not isinstance(response, array.array):
            response = array.array("i", response)  # pickles as its bytes
        with self._lock:
            if self._lost:
                raise PeerLostError(self._lost)
            job_id = next(self._ids)
            self._pending[job_id] = future
            self._outbox.append((job_id, p.data_source, response, p.ground_truth, key, adapt))
        self._waiter.wake()
        return future

    def close(self) -> None:
        self._closing = True
        self._waiter.wake()
        self._thread.join()
        self._sock.disable_monitor()
        self._hangups.close(linger=0)
        self._sock.close(linger=0)
        self._waiter.close()

    def _run(self) -> None:
        while not self._closing:
            events = self._waiter.wait()
            jobs = []
            while self._outbox:
                jobs.append(self._outbox.popleft())
            if jobs:
                self._sock.send(pickle.dumps(jobs, pickle.HIGHEST_PROTOCOL))
            while self._sock in events:
                try:
                    payload = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for job_id, score, error in pickle.loads(payload):
                    future = self._pending.pop(job_id)
                    if error is None:
                        future.set_result(score)
                    else:
                        future.set_exception(ValueError(error))
            if self._hangups in events:
                self._fail_pending()

    def _fail_pending(self) -> None:
        with self._lock:
            self._lost = f"the node's reward pool ({self.address}) hung up: its rank's process died"
            pending, self._pending = self._pending, {}
        if pending:
            log.error("%s; failing the %d scores still awaited", self._lost, len(pending))
        for future in pending.values():
            future.set_exception(PeerLostError(self._lost))


class NodeReward:
    """Collective over ``group`` (every rank): the sink this rank's engine races score with. The
    node's reward pool (``cfg``, ``tokenizer``) runs on the node's first rank (``lead``); the other
    ranks of the node reach it over loopback, through a ``RewardService`` beside it.

    The adaptive code timeouts are the pools' learned state: each node's pool observes the runtimes
    of what it scores, and the pools share what they learned once per step (``share_code_timeouts``),
    so that every node times a prompt's tests as one pool would, and rank 0's pool, which the
    checkpoint saves, holds what all of them learned."""

    def __init__(self, cfg: RewardConfig, *, tokenizer: Any, lead: int, local_size: int, group: Any):
        import torch.distributed as dist

        self.pool = RewardPool(cfg, tokenizer=tokenizer) if dist.get_rank() == lead else None
        self._group = group
        self._nodes = dist.get_world_size(group) // local_size
        self._service = RewardService(self.pool) if self.pool is not None and local_size > 1 else None
        ports: list[int | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(ports, self._service.port if self._service else 0, group=group)
        self.sink: RewardSink = (PoolRewardSink(self.pool) if self.pool is not None
                                 else RemoteRewardSink(f"tcp://127.0.0.1:{ports[lead]}"))

    def share_code_timeouts(self) -> None:
        """Collective: every pool learns the anchors the others observed since the last share (one
        node: nothing to share)."""
        import torch.distributed as dist

        if self._nodes == 1:
            return
        grown = self.pool.code_timeouts.take_grown() if self.pool is not None else {}
        everyone: list[dict | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(everyone, grown, group=self._group)
        if self.pool is not None:
            for anchors in everyone:
                self.pool.code_timeouts.merge(anchors)

    def load_everywhere(self, state: dict[str, Any] | None) -> None:
        """Collective: rank 0's saved pool state (``RewardPool.state_dict``) in every node's pool."""
        import torch.distributed as dist

        if self._nodes == 1:
            if self.pool is not None and state is not None:
                self.pool.load_state_dict(state)
            return
        box = [state]
        dist.broadcast_object_list(box, src=0, group=self._group)
        if self.pool is not None and box[0] is not None:
            self.pool.load_state_dict(box[0])

    def state_dict(self) -> dict[str, Any]:
        """This node's pool's learned state (rank 0's is the one a checkpoint saves)."""
        return self.pool.state_dict()

    def close(self) -> None:
        """A service goes before its sinks (they only note the hang-up), the pool last."""
        if isinstance(self.sink, RemoteRewardSink):
            self.sink.close()
        if self._service is not None:
            self._service.close()
        if self.pool is not None:
            self.pool.close()
