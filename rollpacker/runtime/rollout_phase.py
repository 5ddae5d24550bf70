"""The rollout phase of one step, as every rank runs it.

Rank 0 coordinates: it runs the scheduler over the round's engines (its own
in-process, the others through ``RemoteEngine`` proxies) with rewards scored
in the CPU pool as responses finish. Every other rank plays one role for the
round, chosen by the layout of the round's TP size:

- the leader of an engine serves it to the coordinator (``EngineServer``);
- a non-leader rank of a TP group mirrors its leader's forwards.

When the round ends the coordinator stops every server, each leader releases
its followers, and the kept groups are broadcast to all ranks for training.
"""
from __future__ import annotations

import torch.distributed as dist

from rollpacker.coordinator import EngineServer, Endpoint, RemoteEngine
from rollpacker.reward.sink import PoolRewardSink
from rollpacker.runtime.engines import EngineSets
from rollpacker.sample import Sample
from rollpacker.scheduler import Scheduler
from rollpacker.scheduler.clock import RealClock
from rollpacker.scheduler.round import RoundPlan, RoundResult


class RolloutPhase:
    def __init__(self, engines: EngineSets, endpoints: list[Endpoint], *, scheduler: Scheduler | None,
                 reward: PoolRewardSink | None):
        self.engines, self.endpoints = engines, endpoints
        self.rank = dist.get_rank()
        self.scheduler, self.reward = scheduler, reward  # rank 0 only
        self.server = EngineServer(endpoints[self.rank].address)
        self._proxies: dict[tuple[int, int], RemoteEngine] = {}

    def run(self, plan: RoundPlan | None) -> RoundResult | None:
        """Collective over the world: the round's result on rank 0, None elsewhere."""
        layout, engine = self.engines.layout, self.engines.active
        if self.rank == 0:
            round_engines = [engine if leader == 0 else self._proxy(layout.tp, eid, leader)
                             for eid, leader in enumerate(layout.leaders)]
            result = self.scheduler.run_round(plan, round_engines, self.reward, clock=RealClock())
            for remote in round_engines[1:]:
                remote.stop_serving()
        elif layout.is_leader:
            self.server.serve(engine)
            result = None
        else:
            engine.serve_follower()
            return None
        if layout.tp > 1:
            engine.stop_followers()
        return result

    def _proxy(self, tp: int, engine_id: int, leader: int) -> RemoteEngine:
        key = (tp, engine_id)
        if key not in self._proxies:
            self._proxies[key] = RemoteEngine(self.endpoints[leader], engine_id)
        return self._proxies[key]

    def close(self) -> None:
        for proxy in self._proxies.values():
            proxy.shutdown()
        self.server.close()


def broadcast_groups(groups: list[list[Sample]] | None) -> list[list[Sample]]:
    """Collective: rank 0's kept groups on every rank."""
    box = [groups]
    dist.broadcast_object_list(box, src=0)
    return box[0]
