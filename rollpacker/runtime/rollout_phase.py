"""The rollout phase of one step, as every rank runs it.

Rank 0 coordinates: it runs the scheduler over the round's engines, its own raced in-process,
the others through an ``EngineClient`` each. Every engine races the prompt groups placed on it where
it is, scored by its node's reward pool (``reward/service.py``), and rank 0 hears of each group
once. Every other rank plays one role for the round, chosen by the layout of the round's TP size:

- the leader of an engine serves it to the coordinator (``EngineServer``);
- a non-leader rank of a TP group mirrors its leader's forwards.

In a long round the coordinator may retire an engine midway and hand its ranks
to the stream trainer (``StreamFeed``): its server stops, and those ranks then
train on the groups fed to them until the round ends. When the round ends the
coordinator ends every other engine's race, which stops its server, and each
leader releases its followers.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

from rollpacker.control.engine_server import EngineServer
from rollpacker.control.fleet import ClusterFleet, EngineClient, NewsInbox
from rollpacker.scheduler.calls import StopReason
from rollpacker.control.transport import exchange_endpoints
from rollpacker.runtime.engines import EngineSets
from rollpacker.runtime.streaming import GroupFeed, GroupInbox, StreamFeed, stream_train
from rollpacker.sample import Sample, SampleGroup
from rollpacker.scheduler import Scheduler
from rollpacker.scheduler.clock import RealClock
from rollpacker.scheduler.protocols import Fleet, RewardSink
from rollpacker.scheduler.round import RoundPlan, RoundResult
from rollpacker.trainer.stream import StreamTrainer

T = TypeVar("T")


class RolloutPhase:
    def __init__(self, engines: EngineSets, *, scheduler: Scheduler | None, reward: RewardSink,
                 replica_of: list[int] | None = None, trigger: tuple[float, float] = (0.2, 0.5),
                 engine_wait_s: float = 0.005, fixed_feed: bool = False):
        """Collective. ``reward``: what this rank's engine races score with (its node's pool);
        ``replica_of``: each rank's training replica, to stream-train long rounds (None: never);
        ``engine_wait_s``: how long a serving engine's step may wait for a completion; ``fixed_feed``:
        streamed groups go to fixed replicas in a fixed order (``StreamFeed``)."""
        self.engines = engines
        self.rank = dist.get_rank()
        self.scheduler, self.reward = scheduler, reward  # the scheduler: rank 0 only
        self.engine_wait_s = engine_wait_s
        self.server, self.inbox = EngineServer(), GroupInbox()
        world = engines.world
        self.endpoints = exchange_endpoints(self.server.port, self.inbox.port, group=world.control)
        self._proxies: dict[tuple[int, int], EngineClient] = {}
        self.news_inbox = NewsInbox() if self.rank == 0 else None  # every remote race pushes its news here
        if self.rank == 0:  # every engine's proxy now, while every rank is alive: ZeroMQ reports a
            # connection that closed, but one first made to a rank already gone would just never
            # complete, and rank 0 would wait on it for good (a node lost before a TP size's first round)
            for tp, layout in sorted(world.rollout.items()):
                for engine_id, leader in enumerate(layout.leaders):
                    if leader != 0 and tp in engines.tp_sizes:
                        self._proxy(tp, engine_id, leader)
        self.streaming = None
        if self.rank == 0 and replica_of is not None:
            self.streaming = StreamFeed(GroupFeed(self.endpoints), self.inbox, replica_of, low=trigger[0],
                                        high=trigger[1], fixed=fixed_feed)
        self._acks = GroupFeed(self.endpoints)  # a rank handed to training acknowledges each group to rank 0
        self.streamed: list[SampleGroup] = []  # rank 0: groups trained during the last round

    def run(self, plan: RoundPlan | None) -> tuple[RoundResult | None, bool]:
        """Collective over the world: (the round's result on rank 0, else None;
        whether this rank was handed to training during the round)."""
        def round_(fleet: Fleet) -> RoundResult:
            feed = self.streaming
            result = self.scheduler.run_round(plan, fleet, on_group_done=feed.group_done if feed else None,
                                              handoff=feed.policy(self.engines.layout, plan.prompts) if feed else None)
            self.streamed = feed.end_round() if feed else []
            return result

        return self.on_engines(round_)

    def on_engines(self, work: Callable[[Fleet], T]) -> tuple[T | None, bool]:
        """Collective over the world: rank 0 runs ``work`` over the awake set's engines (its own, and
        the others' through their servers) while their leaders serve and their followers mirror; ``work`` must
        end every race it does not retire to the stream trainer (``EngineDriver.end``): that ends its
        server's loop. Returns (``work``'s result on rank 0, else None; whether this rank was handed
        to training)."""
        layout, engine = self.engines.layout, self.engines.active
        result, reason = None, StopReason.ROUND_END
        if self.rank == 0:
            engines = [engine if leader == 0 else self._proxy(layout.tp, eid, leader)
                       for eid, leader in enumerate(layout.leaders)]
            result = work(ClusterFleet(engines, self.news_inbox, RealClock(), self.reward,
                                       idle_poll_s=self.engine_wait_s))
        elif layout.is_leader:
            reason = self.server.serve(engine, self.reward, self.engine_wait_s)
        else:
            engine.serve_follower()
        if layout.tp > 1:
            if layout.is_leader:
                engine.stop_followers()
            box = [reason]  # followers learn from their leader whether the round ended or they train
            dist.broadcast_object_list(box, src=layout.leader, group=layout.control)
            reason = box[0]
        return result, reason == StopReason.TO_TRAINING

    def stream_train(self, stream: StreamTrainer) -> int:
        """On a rank handed to training: consume the groups fed to it until the rollout ends."""
        return stream_train(self.inbox, stream, ack=lambda key: self._acks.send([0], key))

    def unstreamed(self, result: RoundResult | None) -> list[SampleGroup] | None:
        """Rank 0: the round's groups that no rank trained during rollout."""
        if result is None:
            return None
        done = {id(g) for g in self.streamed}
        return [g for g in result.kept if id(g) not in done]

    def _proxy(self, tp: int, engine_id: int, leader: int) -> EngineClient:
        key = (tp, engine_id)
        if key not in self._proxies:
            self._proxies[key] = EngineClient(self.endpoints[leader], engine_id, self.news_inbox)
        return self._proxies[key]

    def close(self) -> None:
        for proxy in self._proxies.values():
            proxy.shutdown()
        if self.news_inbox is not None:
            self.news_inbox.close()
        if self.streaming:
            self.streaming.close()
        self._acks.close()
        self.server.close()
        self.inbox.close()


def broadcast_groups(groups: list[SampleGroup] | None, group: dist.ProcessGroup) -> list[list[Sample]]:
    """Collective over ``group`` (the control group): rank 0's groups on every rank, unpacked there
    (rank 0 sends each as it came from its engine, still packed)."""
    box = [groups]
    dist.broadcast_object_list(box, src=0, group=group)
    return [g.samples for g in box[0]]
