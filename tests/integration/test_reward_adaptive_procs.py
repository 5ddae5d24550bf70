"""Adaptive code timeouts through a reward pool (worker processes): convergence on known runtimes, the
checkpoint's round trip, and when a sample's timeout is set. The rule itself:
tests/unit/test_reward_adaptive.py."""
from __future__ import annotations

from rollpacker.reward import RewardConfig, RewardPool

SLEEP_THEN_ECHO = "```python\nimport time\ntime.sleep({seconds})\nprint(input())\n```"
CASES = [{"stdin": "a\n", "stdout": "a"}, {"stdin": "b\n", "stdout": "b"}]


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
