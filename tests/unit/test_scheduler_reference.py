"""The scheduler on the real clock, driving two real reference engines.

A random tiny Qwen2 with many stop tokens gives geometric response lengths;
scores come back on a thread pool, as from the reward pool.
"""
from __future__ import annotations

import concurrent.futures
import random
import time
from collections import Counter

import pytest
import torch

from rollpacker.rollout import make_engine
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import GenerationRequest
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource, LocalFleet, RealClock, RoundKind, Scheduler
from rollpacker.scheduler.config import PlannerConfig, SchedulerConfig
from rollpacker.scheduler.group_race import GroupLaunch
from rollpacker.sim.reward import SimScore
from testkit import make_random_qwen2


class ThreadSink:
    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.pool = pool

    def submit(self, sample, *, key=None, adapt=True):
        return self.pool.submit(lambda: SimScore(float(len(sample.response_ids) % 2), None))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_qwen2(tmp_path_factory.mktemp("qwen2"), seed=3)


def test_real_time_rounds_over_two_reference_engines(model_dir):
    torch.set_num_threads(1)
    rollout = RolloutConfig(max_response_length=24, kv_cache_tokens=4096, temperature=1.0)
    engines = [make_engine(rollout, model_dir, engine_id=i) for i in range(2)]
    prompts = [Prompt(uid=i, input_ids=[(7 * i + j) % 250 for j in range(5 + i % 4)], data_source="t")
               for i in range(12)]
    cfg = SchedulerConfig(p0=4, r0=2, planner=PlannerConfig(enabled=False))
    scheduler = Scheduler(cfg, rollout, ListPromptSource(prompts), rollout_ranks=2,
                          stop_token_ids=list(range(0, 250, 9)))  # ~11% stop chance per token
    trained = Counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for expected in [RoundKind.SHORT] * 4 + [RoundKind.LONG]:
            plan = scheduler.plan_round()
            result = scheduler.run_round(plan, LocalFleet(engines, RealClock(), ThreadSink(pool)))
            assert plan.kind is expected and len(result.groups) == 4
            for group in result.groups:
                assert len(group) == 2 and all(s.finish_reason in ("stop", "length") for s in group)
                assert all(s.reward == len(s.response_ids) % 2 for s in group)
                trained[(group[0].prompt.uid, group[0].prompt.epoch)] += 1
            assert all(e.active_request_ids() == [] for e in engines)  # the close aborted the rest
            assert result.stats.generated_tokens >= result.stats.batch_tokens > 0
    assert len(trained) == 20 and set(trained.values()) == {1}  # 4 short rounds' 20 prompts, once each


class SlowSink(ThreadSink):
    """Scores after a random delay: the wall-clock order of ready responses changes from run to run."""

    def __init__(self, pool, seed: int) -> None:
        super().__init__(pool)
        self.rng = random.Random(seed)

    def submit(self, sample, *, key=None, adapt=True):
        delay = self.rng.uniform(0, 0.03)
        return self.pool.submit(lambda: (time.sleep(delay), SimScore(float(len(sample.response_ids) % 2), None))[1])


def race_run(model_dir, race: str, sink_seed: int | None, swap: bool) -> list:
    """Five rounds; per round the kept groups as (uid, epoch, responses) and the deferred uids."""
    rollout = RolloutConfig(max_response_length=24, kv_cache_tokens=4096, temperature=1.0)
    engines = [make_engine(rollout, model_dir, engine_id=i) for i in range(2)]
    if swap:
        engines.reverse()
    prompts = [Prompt(uid=i, input_ids=[(7 * i + j) % 250 for j in range(5 + i % 4)], data_source="t")
               for i in range(12)]
    cfg = SchedulerConfig(p0=4, r0=2, race=race, planner=PlannerConfig(enabled=False))
    scheduler = Scheduler(cfg, rollout, ListPromptSource(prompts), rollout_ranks=2,
                          stop_token_ids=list(range(0, 250, 9)))
    rounds = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sink = ThreadSink(pool) if sink_seed is None else SlowSink(pool, sink_seed)
        for _ in range(5):
            result = scheduler.run_round(scheduler.plan_round(), LocalFleet(engines, RealClock(), sink))
            rounds.append(([(g[0].prompt.uid, g[0].prompt.epoch, [(s.response_index, list(s.response_ids))
                                                                    for s in g]) for g in result.groups],
                           sorted(p.uid for p in result.deferred)))
    return rounds


def test_the_deterministic_race_keeps_the_same_groups_whatever_the_timing(model_dir):
    """Scores delayed at random and the engines swapped change which responses are ready first; the
    deterministic race keeps the same groups, in the same order, with the same responses."""
    torch.set_num_threads(1)
    quiet = race_run(model_dir, "deterministic", None, swap=False)
    noisy = race_run(model_dir, "deterministic", 7, swap=True)
    clock = race_run(model_dir, "first_finished", 7, swap=True)
    differ = sum(a != b for a, b in zip(quiet, clock))
    print(f"rounds kept/deferred alike: deterministic {sum(a == b for a, b in zip(quiet, noisy))} of 5; "
          f"first_finished under the same noise differs from it in {differ} of 5")
    assert quiet == noisy
    for kept, _ in quiet[:4]:  # short rounds: each group's r0 are its shortest, in response order
        for _, _, responses in kept:
            assert [r for r, _ in responses] == sorted(r for r, _ in responses)


def test_the_deterministic_race_keeps_the_prompts_of_the_least_marks(model_dir):
    """Against an oracle that generates every launched response to the end: a short round keeps the
    P0 prompts whose r0-th shortest responses are shortest (ties by the seeded key), each with its r0
    shortest responses."""
    torch.set_num_threads(1)
    rollout = RolloutConfig(max_response_length=24, kv_cache_tokens=4096, temperature=1.0)
    engines = [make_engine(rollout, model_dir, engine_id=i) for i in range(2)]
    prompts = [Prompt(uid=i, input_ids=[(5 * i + j) % 250 for j in range(4 + i % 5)], data_source="t")
               for i in range(12)]
    scheduler = Scheduler(SchedulerConfig(p0=4, r0=2, race="deterministic", planner=PlannerConfig(enabled=False)),
                          rollout, ListPromptSource(prompts), rollout_ranks=2, stop_token_ids=list(range(0, 250, 9)))
    plan = scheduler.plan_round()
    oracle = make_engine(rollout, model_dir, engine_id=5)
    marks = {}
    for p in plan.prompts:
        prefix = f"p{p.uid}e{p.epoch}r"
        g = GroupLaunch(0, p, plan.n_responses, 2, prefix, f"{scheduler.sampling.seed or 0}:{plan.index}:{prefix}",
                        scheduler.sampling)
        oracle.submit([GenerationRequest(g.request_id(r), p.input_ids, g.params.with_seed(g.seed(r)))
                       for r in range(g.n)])
        done = {}
        while oracle.active_request_ids():
            done.update((c.request_id, c) for c in oracle.poll(None))
        by_length = sorted((len(done[g.request_id(r)].output_ids), r) for r in range(g.n))
        marks[p.uid] = ((by_length[1][0], g.tie), sorted(r for _, r in by_length[:2]))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        result = scheduler.run_round(plan, LocalFleet(engines, RealClock(), SlowSink(pool, 3)))
    least = sorted(marks, key=lambda uid: marks[uid][0])[:4]
    print(f"launched {len(plan.prompts)} prompts x {plan.n_responses}; marks (length, tie) "
          f"{sorted(m for m, _ in marks.values())}; kept {sorted(g[0].prompt.uid for g in result.groups)}")
    assert [g[0].prompt.uid for g in result.groups] == sorted(least, key=lambda uid: plan.prompts.index(
        next(p for p in plan.prompts if p.uid == uid)))  # launch order
    for g in result.groups:
        assert [s.response_index for s in g] == marks[g[0].prompt.uid][1]
    assert sorted(p.uid for p in result.deferred) == sorted(set(marks) - set(least))
