"""Adaptive code timeouts: the rule, its merge across nodes and its checkpoint's validation. Its convergence
on known runtimes, through a reward pool's worker processes: tests/integration/test_reward_adaptive_procs.py."""
from __future__ import annotations

import pytest

from rollpacker.reward import RewardConfig
from rollpacker.reward.adaptive import CodeTimeouts


def test_rule_clamps_and_anchors_only_grow():
    t = CodeTimeouts(RewardConfig(code_t_min=2.0, code_t_max=30.0, code_lambda=1.5))
    assert t.timeouts("p", 3) == (30.0, 30.0, 30.0)  # nothing passed yet: the full budget
    t.observe("p", {0: 0.5, 1: 4.0, 2: 25.0})
    assert t.timeouts("p", 3) == (2.0, 6.0, 30.0)  # T_min, λ·anchor, T_max
    t.observe("p", {1: 3.0})
    assert t.anchor("p", 1) == 4.0
    assert CodeTimeouts(RewardConfig(code_timeout="fixed", code_fixed_timeout=7.0)).timeouts("p", 2) == (7.0, 7.0)


def test_pools_of_two_nodes_share_what_grew_and_end_as_one_pool_would():
    """Each node's pool tells the others only the anchors that grew there since it last told them;
    merged, both hold what a single pool that had seen every runtime would."""
    cfg = RewardConfig(code_t_min=2.0, code_t_max=30.0, code_lambda=1.5)
    a, b, one = CodeTimeouts(cfg), CodeTimeouts(cfg), CodeTimeouts(cfg)
    for pool, runtimes in ((a, {0: 1.0, 1: 4.0}), (b, {1: 6.0, 2: 0.5}), (a, {1: 3.0})):
        pool.observe("p", runtimes)
        one.observe("p", runtimes)
    told_a, told_b = a.take_grown(), b.take_grown()
    assert told_a == {"p#0": 1.0, "p#1": 4.0} and told_b == {"p#1": 6.0, "p#2": 0.5}
    for pool in (a, b):
        pool.merge(told_a)
        pool.merge(told_b)
    assert a.state_dict() == b.state_dict() == one.state_dict()
    assert a.timeouts("p", 3) == one.timeouts("p", 3) == (2.0, 9.0, 2.0)
    assert a.take_grown() == {} and b.take_grown() == {}  # merged anchors are not news to tell again


def test_state_is_validated_on_load():
    t = CodeTimeouts(RewardConfig())
    with pytest.raises(ValueError, match="anchors"):
        t.load_state_dict({"anchors": {"p#0": -1.0}})
