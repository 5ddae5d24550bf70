"""The scheduler on the real clock, driving two real reference engines.

A random tiny Qwen2 with many stop tokens gives geometric response lengths;
scores come back on a thread pool, as from the reward pool.
"""
from __future__ import annotations

import concurrent.futures
from collections import Counter

import pytest
import torch

from rollpacker.rollout import make_engine
from rollpacker.rollout.config import RolloutConfig
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource, LocalFleet, RealClock, RoundKind, Scheduler
from rollpacker.scheduler.config import PlannerConfig, SchedulerConfig
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
