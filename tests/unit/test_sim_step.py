"""The whole-step model (``rollpacker.sim.step``): the reward workers' queue, the stream trainer's
overlap, the ablation's rows on a small modeled cluster and ``rollpacker-sim --end-to-end``."""
from __future__ import annotations

import json

import pytest

from rollpacker.sample import Prompt, Sample
from rollpacker.scheduler import VirtualClock
from rollpacker.sim.__main__ import main
from rollpacker.sim.perf import H800, QWEN25
from rollpacker.sim.reward import SimRewardSink
from rollpacker.sim.run import SimSettings
from rollpacker.sim.step import ABLATION, StepCosts, run_ablation, streamed, summarize_steps
from rollpacker.sim.traces import longtail_trace

SMALL = ["--model", "7b", "--gpus", "8", "--p0", "32", "--r0", "4", "--limit", "4096", "--rounds", "5",
         "--tp", "1", "--max-tp", "4"]


def sample(uid: int, index: int = 0) -> Sample:
    return Sample(prompt=Prompt(uid=uid, input_ids=[0] * 4, data_source="t"), response_index=index)


def test_reward_workers_queue_the_scores_in_submission_order():
    clock = VirtualClock()
    sink = SimRewardSink(clock, latency_fn=lambda s: 1.0 + s.prompt.uid, workers=2)
    futures = [sink.submit(sample(uid)) for uid in (0, 1, 2)]  # 1 s and 2 s at once, 3 s after the first
    due = []
    while (t := sink.next_event_time()) is not None:
        clock.advance_to(t)
        due.append((t, [f.done() for f in futures]))
    assert due == [(1.0, [True, False, False]), (2.0, [True, True, False]), (4.0, [True, True, True])]
    with pytest.raises(ValueError, match="workers"):
        SimRewardSink(clock, workers=0)


def test_reward_latency_is_fixed_per_response_and_hangs_the_stated_share():
    costs = StepCosts(reward_hang_prompts=0.05)
    latencies = [costs.reward_latency(sample(uid, r)) for uid in range(4000) for r in range(8)]
    assert latencies == [costs.reward_latency(sample(uid, r)) for uid in range(4000) for r in range(8)]
    hung_prompts = {i // 8 for i, x in enumerate(latencies) if x == costs.reward_hang_s}
    share = len(hung_prompts) / 4000
    hung_responses = latencies.count(costs.reward_hang_s) / len(latencies)
    print(f"prompts with a hung response: {share:.3f}; responses hung: {hung_responses:.4f}")
    assert 0.04 < share < 0.06  # half of 8 responses: nearly every such prompt has one
    assert 0.02 < hung_responses < 0.03 and set(latencies) == {costs.reward_s, costs.reward_hang_s}


def test_stream_overlap_by_hand():
    # hand-off at 2 s, round closes at 10 s, 100 tokens/s: group A (done at 1 s, 300 tokens) trains
    # 2..5 s, B (done at 8 s, 500 tokens) 8..10 s and only 200 of its tokens
    assert streamed([(8.0, 500), (1.0, 300)], 2.0, 10.0, 100.0) == 500
    assert streamed([(1.0, 300)], None, 10.0, 100.0) == 0  # no hand-off
    assert streamed([(11.0, 300)], 2.0, 10.0, 100.0) == 0  # done after the round closed


def test_ablation_rows_on_a_small_cluster():
    settings = SimSettings(model="7b", gpus=8, tp=1, p0=32, r0=4, limit=4096, rounds=5, max_tp=4)
    trace = longtail_trace(400, samples=5, median=4096 / 28, limit=4096, seed=0)
    costs = StepCosts()
    rows = run_ablation(settings, trace, costs)
    summary = summarize_steps(rows)
    for key, m in summary.items():
        print(key, {k: round(v, 2) for k, v in m.items()})
    assert list(rows) == [c.key for c in ABLATION] and summary["baseline"]["speedup"] == 1.0
    for steps in rows.values():
        assert len(steps) == 5 and all(s.step_s == pytest.approx(s.rollout_s + s.reward_s + s.train_s + s.sync_s)
                                       for s in steps)
    # a reward stage after the round only without async reward; with it, scoring is inside the round
    assert all(s.reward_s > 0 for key in ("baseline", "tail_batching") for s in rows[key])
    assert all(s.reward_s == 0 for key in ("async_reward", "planner", "stream") for s in rows[key])
    assert summary["tail_batching"]["rollout_s"] < summary["baseline"]["rollout_s"]
    assert summary["tail_batching"]["speedup"] > 1.0 and summary["async_reward"]["speedup"] > summary["tail_batching"]["speedup"]
    # every row trains every prompt of its steps: P0 x R0 samples a step
    model = QWEN25["7b"]
    per_token_s = costs.flops_per_token * model.params / (costs.mfu * H800.bf16_flops * settings.gpus)
    for s in rows["planner"]:
        assert s.train_s == pytest.approx(s.trained_tokens * per_token_s)
    # the stream trainer trains part of the long round's batch during it, and only there
    long = [s for s in rows["stream"] if s.kind == "long"]
    assert long and all(s.streamed_tokens > 0 for s in long)
    assert all(s.streamed_tokens == 0 for s in rows["stream"] if s.kind == "short")
    assert summary["stream"]["train_s"] < summary["planner"]["train_s"]


def test_cli_end_to_end(capsys):
    assert main(["--end-to-end", *SMALL]) == 0
    out = capsys.readouterr().out
    assert main(["--end-to-end", "--json", "--train-mfu", "0.5", *SMALL]) == 0
    report = json.loads(capsys.readouterr().out)
    print(out)
    for component in ABLATION:
        assert component.label in out
    assert report["costs"]["mfu"] == 0.5 and set(report["summary"]) == {c.key for c in ABLATION}
    assert len(report["steps"]["stream"]) == 5


@pytest.mark.parametrize("argv, message", [
    (["--train-mfu", "0.5"], "only with --end-to-end"),
    (["--end-to-end", "--planner"], "not with --epochs or --planner"),
    (["--end-to-end", "--train-mfu", "1.5"], "mfu"),
])
def test_cli_refuses_flags_it_would_ignore(argv, message, capsys):
    assert main([*argv, *SMALL]) == 2
    assert message in capsys.readouterr().err
