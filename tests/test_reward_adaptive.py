"""Adaptive code timeouts: the rule, its convergence on known runtimes, and its checkpoint."""
from __future__ import annotations

import pytest

from rollpacker.reward import RewardConfig, RewardPool
from rollpacker.reward.adaptive import CodeTimeouts

SLEEP_THEN_ECHO = "```python\nimport time\ntime.sleep({seconds})\nprint(input())\n```"
CASES = [{"stdin": "a\n", "stdout": "a"}, {"stdin": "b\n", "stdout": "b"}]


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


def test_anchor_converges_to_the_slowest_correct_runtime_and_round_trips():
    # T_min (1 s) must cover a correct 0.3 s solution timed by an anchor the 0.1 s one set first
    cfg = RewardConfig(num_workers=2, code_t_min=1.0, code_t_max=3.0)
    runtimes = [0.1, 0.6, 0.3]  # seconds each correct solution sleeps per case
    with RewardPool(cfg) as pool:
        # a slow wrong answer says nothing about how long a correct solution needs
        slow_wrong_s = 2.2
        slow_wrong = SLEEP_THEN_ECHO.format(seconds=slow_wrong_s).replace("print(input())", "print('z')")
        assert pool.submit("code", slow_wrong, CASES, key="prompt-7").result(timeout=60).reason == "wrong_answer"
        futures = [pool.submit("code", SLEEP_THEN_ECHO.format(seconds=s), CASES, key="prompt-7") for s in runtimes]
        assert all(f.result(timeout=60).correct for f in futures)
        anchors = [pool.code_timeouts.anchor("prompt-7", i) for i in range(2)]
        print(f"anchors {anchors} for correct runtimes {runtimes} s plus interpreter start-up")
        # A runtime is at least its sleep: at or above the slowest correct sleep, the anchor is not the
        # faster ones'; below the wrong answer's sleep, it is not the wrong answer's (start-up included).
        assert all(max(runtimes) <= anchor < slow_wrong_s for anchor in anchors), anchors
        timeouts = pool.code_timeouts.timeouts("prompt-7", 2)
        assert timeouts == tuple(min(max(1.0, 1.5 * a), 3.0) for a in anchors)
        # the tightened timeout now cuts a 2.5 s program that T_max would have let finish; cut at T_max
        # it could not have taken less than T_max on its worker
        late = pool.submit("code", SLEEP_THEN_ECHO.format(seconds=2.5), CASES, key="prompt-7").result(timeout=60)
        print(f"2.5 s program under timeouts {timeouts}: {late.reason} after {late.seconds:.2f} s")
        assert late.reason == "timeout" and late.seconds < 3.0
        state = pool.state_dict()

    with RewardPool(cfg) as restored:
        assert restored.code_timeouts.timeouts("prompt-7", 2) == (3.0, 3.0)
        restored.load_state_dict(state)
        assert restored.code_timeouts.timeouts("prompt-7", 2) == timeouts
        assert restored.state_dict() == state


def test_timeouts_are_set_when_a_sample_reaches_a_worker_not_when_it_is_submitted():
    """A looping sample queued behind a correct one of the same prompt gets the learned timeout."""
    cfg = RewardConfig(num_workers=1, code_t_min=0.5, code_t_max=3.0)
    loop = "```python\nwhile True:\n    pass\n```"
    with RewardPool(cfg) as pool:
        correct = pool.submit("code", SLEEP_THEN_ECHO.format(seconds=0.1), CASES, key="p")
        looping = pool.submit("code", loop, CASES, key="p")  # submitted before any anchor exists
        assert correct.result(timeout=60).correct
        score = looping.result(timeout=60)
    expected = pool.code_timeouts.timeouts("p", 2)[0]
    print(f"looping sample: {score.reason} after {score.seconds:.2f} s, learned timeout {expected:.2f} s")
    # cut no earlier than the learned timeout, and before T_max (3 s), which a cut at T_max cannot be
    assert score.reason == "timeout" and expected <= score.seconds < 3.0
