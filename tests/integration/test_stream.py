"""Stream trainer on 2 data-parallel ranks (real torchrun, gloo, the Megatron Qwen2 model):
a step fed in any order, split between ranks and remainder in any way, equals the one-shot step."""
from __future__ import annotations

import json

import pytest

from testkit import make_random_qwen2, run_torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("stream")
    model_dir = make_random_qwen2(tmp / "model", seed=7)
    out = tmp / "out.json"
    run_torchrun(2, ["tests/dist/trainer_stream.py", str(model_dir), str(out)], timeout=300)
    return json.loads(out.read_text())


# About 10x the measured worst cases (README: gradients 1.8e-7 relative; parameters 1.6e-7 relative,
# loss 2.0e-8 absolute): fp32 sums of the same terms in another order (bursts, DP splits) differ by a
# few ulps, where a group trained twice or dropped would move the gradient by about 1/24.
GRAD_TOL, PARAM_TOL, LOSS_TOL = 2e-6, 2e-6, 2e-7


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_streamed_gradient_equals_one_shot(results, aggregation):
    r = results[aggregation]
    assert len(r["streamed"]) == 5
    for run in r["streamed"]:
        loss_diff = abs(run["metrics"]["loss"] - r["one_shot"]["loss"])
        print(f"{aggregation} {run['split']}: relative |dgrad| {run['rel_grad_diff']:.2e}, "
              f"|dparam| {run['rel_param_diff']:.2e}, |dloss| {loss_diff:.2e}")
        assert run["rel_grad_diff"] < GRAD_TOL, run
        assert run["rel_param_diff"] < PARAM_TOL, run
        assert run["metrics"]["skipped"] == 0
        assert run["metrics"]["tokens"] == r["one_shot"]["tokens"]
        assert run["metrics"]["sequences"] == r["one_shot"]["sequences"] == 24
        assert loss_diff < LOSS_TOL


def test_stream_accounting(results):
    r = results["token_mean"]
    assert r["one_shot"]["stream_groups_before_rollout_end"] == 0
    assert r["one_shot"]["stream_overlap_share"] == 0.0
    everything_streamed = r["streamed"][0]
    assert everything_streamed["split"] == ["r1"] * 6
    assert everything_streamed["metrics"]["stream_groups_before_rollout_end"] == 6
    assert everything_streamed["metrics"]["stream_overlap_share"] == 1.0
    for run in r["streamed"][1:4]:
        streamed = sum(w != "rest" for w in run["split"])
        assert run["metrics"]["stream_groups_before_rollout_end"] == streamed
        assert 0.0 < run["metrics"]["stream_overlap_share"] < 1.0 or streamed in (0, 6)
    # The rollout ended after rank 1's first burst, but rank 1 learned of it only after training every
    # burst: what it trained after the end counts as after, in groups, tokens and seconds.
    late = r["streamed"][4]
    assert late["split"] == ["r1"] * 6 and len(late["bursts"]) > 1
    m = late["metrics"]
    assert m["stream_groups_before_rollout_end"] == late["bursts"][0]
    assert 0.0 < m["stream_overlap_share"] < 1.0
    assert m["stream_compute_s_before"] > 0.0 and m["stream_compute_s_after"] > 0.0


def test_one_optimizer_step_and_replicas_agree(results):
    for r in results.values():
        assert r["optimizer_steps"] == 1  # AdamW's step counter after the last (streamed) step
        assert r["replicas_equal_after_step"]
