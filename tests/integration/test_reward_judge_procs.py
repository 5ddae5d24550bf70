"""A reward pool (worker processes) routes judge samples to the LLM judge, here on the scripted engine of
tests/unit/test_reward_judge.py, where the judge's own logic is tested."""
from __future__ import annotations

from rollpacker.reward.scorers.judge import LLMJudge
from tests.unit.test_reward_judge import CharTokenizer, ScriptedEngine


def test_pool_routes_judge_samples_to_the_judge():
    from rollpacker.reward import RewardConfig, RewardPool

    engine = ScriptedEngine({"right": "CORRECT"})
    with RewardPool(RewardConfig(num_workers=1), judge=LLMJudge(engine, CharTokenizer())) as pool:
        assert pool.submit("judge", "right", "42").result(timeout=30).reason == "ok"
