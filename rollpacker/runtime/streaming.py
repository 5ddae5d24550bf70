"""The stream trainer's side of a long round, as the program runs it.

Rank 0 decides, through the scheduler's ``HandoffPolicy``, when engines leave
the round; this module says *which* engines may leave and feeds their ranks.
An engine may leave only if its ranks are whole training replicas (every
rank of a replica's TP/PP/CP group inside it) and it is not rank 0's own.
From the hand-off on, kept groups (those kept before it first) go to the
replica with the fewest tokens so far that has room in its window; every
rank of that replica receives the group, runs forward/backward on it and
acknowledges it. When the round ends the replicas are told when it ended
(:class:`RolloutEnded`), and the groups nobody streamed are trained by every replica in the step's
``finish``, balanced against what each already streamed.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch.distributed as dist
import zmq

from rollpacker.control.transport import GROUP_INBOX_PORT, Channel, Endpoint, bind, context
from rollpacker.runtime.world import RolloutLayout
from rollpacker.sample import Prompt, SampleGroup
from rollpacker.scheduler.handoff import HandoffPolicy
from rollpacker.trainer.stream import StreamTrainer, group_key, replica_for
from rollpacker.wakeup import Waiter

Group = SampleGroup


@dataclass(frozen=True)
class RolloutEnded:
    """The round's rollout ended at wall-clock time ``at``: the last message a streaming rank gets."""
    at: float


def _key(group: Group) -> tuple[int, int]:
    return group_key(group.prompt)


class GroupInbox:
    """A rank's end of the stream-trainer feed: prompt groups pushed by the coordinator."""

    def __init__(self):
        self._channel = Channel(zmq.PULL, "the coordinator (rank 0), feeding this rank's stream trainer,")
        self.port = bind(self._channel.sock, GROUP_INBOX_PORT)

    def receive(self) -> Any:
        """The next message on a rank handed to training: a finished prompt group, or the end of the
        round's rollout (``RolloutEnded``)."""
        self._channel.ready(None)
        return self._channel.sock.recv_pyobj()

    @property
    def socket(self) -> zmq.Socket:
        return self._channel.sock

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
        """``group`` to each of ``ranks`` (one data-parallel replica); ``RolloutEnded`` ends their round."""
        for rank in ranks:
            if rank not in self._socks:
                sock = context().socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(self._endpoints[rank].inbox)
                self._socks[rank] = sock
            self._socks[rank].send_pyobj(group)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()


class StreamFeed:
    """Rank 0: hands engines to training mid-round and streams kept groups to their ranks.

    A feeder thread keeps at most ``window`` unacknowledged groups at each training replica,
    so that a replica never builds a backlog: groups it would only reach after the rollout
    ended stay here and are shared by every replica in the step's ``finish``.
    """

    def __init__(self, feed: GroupFeed, acks: GroupInbox, replica_of: Sequence[int], *, low: float, high: float,
                 window: int = 2, fixed: bool = False):
        """``fixed``: each group goes to the replica ``replica_for`` names, in key order (a replica gets
        a group only after every one of its groups that comes before it), and what a replica did not
        get it trains in the step's ``finish(fixed=True)``: the deterministic race's assignment."""
        self.feed, self.acks, self.replica_of = feed, acks, list(replica_of)
        self.low, self.high, self.window, self.fixed = low, high, window, fixed
        self.dp = len(set(self.replica_of))
        self._waiter = Waiter(acks.socket)  # the feeder sleeps until an acknowledgement or a group (or the end) comes
        self._start_round(None)

    def policy(self, layout: RolloutLayout, prompts: Sequence[Prompt] = ()) -> HandoffPolicy | None:
        """This round's hand-off policy, or None when no engine can leave; ``prompts``: the round's
        (a fixed feed hands each replica its groups in their order)."""
        self._start_round(layout)
        self._order = sorted(group_key(p) for p in prompts)
        candidates = tuple(e for e in reversed(range(1, len(layout.leaders))) if self._whole_replicas(layout, e))
        if not candidates:
            return None
        return HandoffPolicy(candidates=candidates, on_release=self._release, low=self.low, high=self.high)

    def group_done(self, group: Group) -> None:
        self._incoming.put(group)
        self._waiter.wake()

    def end_round(self) -> list[Group]:
        """Stop feeding, tell the training replicas the rollout is over; returns the groups they got."""
        ended = RolloutEnded(time.time())
        if self._feeder is not None:
            self._incoming.put(None)
            self._waiter.wake()
            self._feeder.join()
        for ranks in self._replicas:
            self.feed.send(ranks, ended)
        streamed = self._streamed
        self._start_round(None)
        return streamed

    def close(self) -> None:
        self.feed.close()
        self._waiter.close()

    # --- internals ---------------------------------------------------------------------------------
    def _start_round(self, layout: RolloutLayout | None) -> None:
        self._layout = layout
        self._replicas: list[list[int]] = []  # ranks of each replica now training
        self._incoming: queue.Queue[Group | None] = queue.Queue()
        self._streamed: list[Group] = []
        self._feeder: threading.Thread | None = None

    def _whole_replicas(self, layout: RolloutLayout, engine_id: int) -> bool:
        ranks = set(layout.ranks_of(engine_id))
        replicas = {self.replica_of[r] for r in ranks}
        return all(r in ranks for r, rep in enumerate(self.replica_of) if rep in replicas)

    def _release(self, engine_ids: list[int]) -> None:
        for e in engine_ids:  # retired by the round: their servers stopped, their ranks train
            ranks = self._layout.ranks_of(e)
            for rep in sorted({self.replica_of[r] for r in ranks}):
                self._replicas.append([r for r in ranks if self.replica_of[r] == rep])
        self.acks.drain()  # stale acknowledgements of an earlier round
        self._feeder = threading.Thread(target=self._feed, name="stream-feeder", daemon=True)
        self._feeder.start()

    def _feed(self) -> None:
        """The feeder thread: the only user of the feed and ack sockets until ``end_round``."""
        waiting: list[Group] = []
        in_flight: list[set[tuple[int, int]]] = [set() for _ in self._replicas]
        tokens = [0] * len(self._replicas)
        # fixed: each training replica's groups in the order it must train them
        mine = [[k for k in self._order if replica_for(k, self.dp) == self.replica_of[ranks[0]]]
                for ranks in self._replicas]
        ending = False
        while True:
            with contextlib.suppress(queue.Empty):
                while True:
                    group = self._incoming.get_nowait()
                    if group is None:
                        ending = True
                    else:
                        waiting.append(group)
            for key in self.acks.drain():
                for keys in in_flight:
                    keys.discard(key)
            while pick := self._next(waiting, in_flight, tokens, mine):
                i, group = pick
                waiting.remove(group)
                self.feed.send(self._replicas[i], group)
                in_flight[i].add(_key(group))
                tokens[i] += len(group) * len(group.prompt.input_ids) + sum(group.lengths)  # as packed
                self._streamed.append(group)
            if ending:
                return
            self._waiter.wait()  # a wake is drained before the next look at what was handed over

    def _next(self, waiting: list[Group], in_flight: list[set[tuple[int, int]]], tokens: list[int],
              mine: list[list[tuple[int, int]]]) -> tuple[int, Group] | None:
        """The replica and group to send next, if any: the first waiting group to the replica with the
        fewest tokens that has room; fixed, a replica's next group in its order once it is here."""
        free = [i for i, keys in enumerate(in_flight) if len(keys) < self.window]
        if not self.fixed:
            return (min(free, key=tokens.__getitem__), waiting[0]) if waiting and free else None
        here = {_key(g): g for g in waiting}
        for i in free:
            if mine[i] and mine[i][0] in here:
                return i, here[mine[i].pop(0)]
        return None


def stream_train(inbox: GroupInbox, stream: StreamTrainer, ack: Callable[[tuple[int, int]], None]) -> int:
    """A rank handed to training mid-round: forward/backward on each group fed to it until the
    rollout ends, acknowledging each; gradients stay local until the step's ``finish``.
    Returns the groups trained."""
    stream.begin()
    n = 0
    while not isinstance(message := inbox.receive(), RolloutEnded):
        stream.consume([message.samples])
        ack(_key(message))
        n += 1
    stream.end_rollout(at=message.at)
    return n


def replica_of_ranks(dp_rank: int, group: dist.ProcessGroup) -> list[int]:
    """Collective over ``group`` (the control group): every rank's training replica (its data-parallel
    rank: TP, PP and CP peers share one)."""
    everyone: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, dp_rank, group=group)
    return [int(x) for x in everyone]
