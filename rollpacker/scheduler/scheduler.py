"""The rollout scheduler: plans rounds, runs them over engines, keeps the queue.

Two phases per step so that the program can regroup its ranks in between::

    plan = scheduler.plan_round()              # kind, tp, prompts, n
    fleet = regroup(plan.tp)                   # program's job: the engines, as a Fleet
    result = scheduler.run_round(plan, fleet)
    trainer.step(result.groups)

``state_dict`` is valid between rounds (not between ``plan_round`` and
``run_round``, when the planned prompts are in flight): it holds the
long-prompt queue, the planner, the counters and, with
``scheduler.history``, the per-prompt history and the prompts it staged;
the data cursor is the ``PromptSource``'s own state and is saved beside it.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator, Sequence

from rollpacker.configlib import ConfigError
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import SamplingParams
from rollpacker.sample import Prompt
from rollpacker.scheduler.admission import FreshAdmission, HistoryAdmission
from rollpacker.scheduler.clock import VirtualClock
from rollpacker.scheduler.config import SchedulerConfig, TPProfile
from rollpacker.scheduler.group_race import GroupLaunch
from rollpacker.scheduler.handoff import HandoffPolicy, HandoffTrigger
from rollpacker.scheduler.history import PromptHistory
from rollpacker.scheduler.modes import make_policy, races
from rollpacker.scheduler.planner import ParallelismPlanner
from rollpacker.scheduler.protocols import Fleet, PromptSource
from rollpacker.scheduler.queue import LongPromptQueue
from rollpacker.scheduler.round_runner import EngineDriver, GroupCallback, RoundRunner
from rollpacker.scheduler.round import RoundKind, RoundPlan, RoundResult

_COUNTERS = ("rounds", "launched", "kept", "filtered", "deferred", "routed")


class Scheduler:
    """Tail batching (or a baseline) over any set of ``RolloutEngine``s.

    ``async_reward`` True scores every response the moment it finishes and a
    prompt is done only when R0 responses are generated *and* scored; False
    is the "reward after rollout" ablation (``RewardConfig.async_scoring``):
    groups complete on generation and the batch is scored after the round.
    ``profile``: measured or modeled ``TPProfile`` rows for the planner.
    """

    def __init__(self, cfg: SchedulerConfig, rollout: RolloutConfig, source: PromptSource, *,
                 rollout_ranks: int, stop_token_ids: Sequence[int] = (), async_reward: bool = True,
                 profile: Sequence[TPProfile] = ()) -> None:
        cfg.validate()
        rollout.validate()
        if cfg.mode == "dynamic_sampling" and not async_reward:
            raise ConfigError("scheduler.mode=dynamic_sampling filters groups on their rewards during the race; "
                              "it needs asynchronous reward (reward.async_scoring=true)")
        self.cfg = cfg
        self.source = source
        self.async_reward = async_reward
        self.rollout_ranks = rollout_ranks
        self.sampling = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                       max_new_tokens=rollout.max_response_length,
                                       stop_token_ids=tuple(stop_token_ids), seed=rollout.seed)
        self.history = PromptHistory(cfg.history) if cfg.history.enabled and races(cfg.mode) else None
        self.policy = make_policy(cfg, HistoryAdmission(cfg, self.history) if self.history is not None else FreshAdmission(cfg))
        self.queue = LongPromptQueue()
        self.planner = ParallelismPlanner(cfg.planner, rollout_ranks, fixed_tp=rollout.tp, fixed_ep=rollout.ep,
                                          profile=profile)
        self._seeded = rollout.seeded
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._pending: RoundPlan | None = None

    def plan_round(self) -> RoundPlan:
        if self._pending is not None:
            raise RuntimeError(f"round {self._pending.index} was planned and not run")
        spec = self.policy.next_round(self.queue, self.source)
        self.counters["routed"] += spec.routed
        layout = self.planner.layout_for(spec.kind, requests=len(spec.prompts) * spec.n_responses,
                                         max_response_tokens=self.sampling.max_new_tokens)
        self._pending = RoundPlan(index=self.counters["rounds"], kind=spec.kind, tp=layout.tp,
                                  prompts=tuple(spec.prompts), n_responses=spec.n_responses,
                                  target_groups=self.cfg.p0, ep=layout.ep)
        return self._pending

    def run_round(self, plan: RoundPlan, fleet: Fleet, *, on_group_done: GroupCallback | None = None,
                  handoff: HandoffPolicy | None = None) -> RoundResult:
        """Run ``plan`` to P0 kept groups over ``fleet``'s engines; ``on_group_done(group)`` fires as each
        group is kept (after the reward stage in synchronous-reward mode).
        ``handoff``: in a long round, when and which engines go to the stream trainer."""
        if plan is not self._pending:
            raise RuntimeError("run_round needs the plan returned by the last plan_round")
        if fleet.size * plan.tp != self.rollout_ranks:
            raise ValueError(f"round {plan.index} plans TP {plan.tp} over {self.rollout_ranks} rollout ranks, "
                             f"i.e. {self.rollout_ranks // plan.tp} engines; got {fleet.size}")
        if plan.n_responses < self.cfg.r0:
            raise ValueError(f"plan launches {plan.n_responses} responses per prompt, fewer than r0={self.cfg.r0}")
        logical = self.races_by_length(fleet)
        trigger = (HandoffTrigger(handoff, len(plan.prompts) * plan.n_responses, fleet.size)
                   if handoff is not None and plan.kind is RoundKind.LONG else None)

        def launch(prompt: Prompt) -> GroupLaunch:
            prefix = f"p{prompt.uid}e{prompt.epoch}r"  # ``Sample.request_id``
            # seeds from the run's seed, the round and the request id (``GroupLaunch.seed``)
            return GroupLaunch(0, prompt, plan.n_responses, self.cfg.r0, prefix,
                               f"{self.sampling.seed or 0}:{plan.index}:{prefix}", self.sampling,
                               scored=self.async_reward, reward_key=f"p{prompt.uid}", logical=logical)

        def replacement() -> GroupLaunch | None:
            prompt = self.policy.replacement(plan.kind, self.queue, self.source)
            return None if prompt is None else launch(prompt)

        runner = RoundRunner(
            plan, driver=EngineDriver(fleet, progress=trigger is not None), launches=[launch(p) for p in plan.prompts],
            async_reward=self.async_reward, keeps=self.policy.keeps, replacement=replacement,
            on_group_done=on_group_done, handoff=trigger, logical=logical)
        with _no_collection_during_the_round():
            result = runner.run()
        self._pending = None
        self.queue.push(result.deferred)
        if self.history is not None:
            self.history.observe(result)
        result.stats.queue_length = len(self.queue)
        s = result.stats
        # the measured preemptions depend on timing (when requests were admitted, when the round closed):
        # a deterministic run keeps each round kind's starting TP
        self.planner.observe(plan.kind, None if logical else s.preemptions, s.batch_tokens / max(1, result.num_samples))
        for key, n in zip(_COUNTERS, (1, s.launched_prompts, s.kept_prompts, s.filtered_prompts, s.deferred_prompts)):
            self.counters[key] += n
        return result

    def races_by_length(self, fleet: Fleet) -> bool:
        """Whether rounds on ``fleet`` run the deterministic race (``SchedulerConfig.race``)."""
        return self.cfg.races_by_length(self._seeded, virtual_clock=isinstance(fleet.clock, VirtualClock))

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            raise RuntimeError(f"cannot save while round {self._pending.index} is planned and not run")
        return {"mode": self.cfg.mode, "queue": self.queue.state_dict(), "planner": self.planner.state_dict(),
                "counters": dict(self.counters), "admission": self.policy.state_dict(),
                **({"history": self.history.state_dict()} if self.history is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["mode"] != self.cfg.mode:
            raise ValueError(f"checkpoint was written in mode {state['mode']!r}, this run is {self.cfg.mode!r}")
        self.queue.load_state_dict(state["queue"])
        self.planner.load_state_dict(state["planner"])
        # checkpoints written before history existed lack its entries: history starts empty
        self.counters = {k: int(state["counters"].get(k, 0)) for k in _COUNTERS}
        self.policy.load_state_dict(state.get("admission", {}))
        if self.history is not None and "history" in state:
            self.history.load_state_dict(state["history"])


@contextlib.contextmanager
def _no_collection_during_the_round() -> Iterator[None]:
    """The cyclic garbage collector does not run during a round; it resumes when the round ends.

    A round makes several container objects per request and keeps most of them until it ends
    (samples, requests, placements, the reward pool's futures). Each of them set off and then sat
    through the collector's passes, young and full: a third of rank 0's Python time at 512 engines
    (``bench/system/control.py``), for nothing, since the round drops its garbage by refcounting and
    makes no cycles of its own. A cycle something else drops meanwhile waits for the first pass after
    the round. A collector someone else switched off stays off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
