"""GRPO objective against hand-computed numbers (clipping on both sides, both aggregations)."""
from __future__ import annotations

import math

import pytest
import torch

from rollpacker.configlib import ConfigError, build
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer import mismatch
from rollpacker.trainer.grpo import (LossSums, denominator, group_advantages, grpo_token_loss, k3_kl, step_metrics,
                                     token_weights)

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    std = math.sqrt(1 / 3)  # unbiased: sum of 4 * 0.25 over n - 1 = 3
    adv = group_advantages(rewards, std_normalize=True, eps=1e-6)
    a = 0.5 / (std + 1e-6)
    assert adv.tolist() == pytest.approx([a, -a, -a, a], rel=1e-12)
    assert group_advantages(rewards, std_normalize=False).tolist() == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages(torch.tensor([1.0, 1.0, 1.0])).tolist() == [0.0, 0.0, 0.0]  # no signal, eps keeps it finite
    assert group_advantages(torch.tensor([3.0])).tolist() == [0.0]
    with pytest.raises(ValueError, match="non-empty 1-D"):
        group_advantages(torch.tensor([]))


def _batch():
    """Two sequences, padded to 3 positions: A (advantage +1, 2 tokens), B (advantage -1, 3 tokens).

    Ratios: A = [1.5, 0.5], B = [1.5, 0.5, 1.0]; clip range [0.8, 1.28].
    Per-token loss max(-A r, -A clip(r)):
      A: max(-1.5, -1.28) = -1.28 (clipped high), max(-0.5, -0.8) = -0.5
      B: max(1.5, 1.28) = 1.5, max(0.5, 0.8) = 0.8 (clipped low), 1.0
    """
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    starts = torch.tensor([[1.0, 0, 0], [1.0, 0, 0]])
    return logp, old, adv, mask, starts


@pytest.mark.parametrize("aggregation,expected_loss,expected_grad", [
    # token mean: sum -1.28 - 0.5 + 1.5 + 0.8 + 1.0 = 1.52 over 5 tokens; d/dlogp = -A r / 5 where unclipped
    ("token_mean", 1.52 / 5, [[0.0, -0.5 / 5, 0.0], [1.5 / 5, 0.0, 1.0 / 5]]),
    # sequence mean: A mean -0.89, B mean 3.3 / 3 = 1.1, over 2 sequences
    ("seq_mean", (-0.89 + 1.1) / 2, [[0.0, -0.5 / 4, 0.0], [1.5 / 6, 0.0, 1.0 / 6]]),
])
def test_clipped_surrogate_by_hand(aggregation, expected_loss, expected_grad):
    logp, old, adv, mask, starts = _batch()
    w = token_weights([2, 3], aggregation)
    weights = torch.tensor([[w[0]] * 3, [w[1]] * 3], dtype=torch.float64)
    sums = grpo_token_loss(logp, advantages=adv, loss_mask=mask, weights=weights, clip_low=CLIP_LOW,
                           clip_high=CLIP_HIGH, old_logprobs=old, sequence_starts=starts)
    denom = denominator(int(sums.tokens), int(sums.sequences), aggregation)
    assert (int(sums.tokens), int(sums.sequences)) == (5, 2)
    (sums.objective / denom).backward()
    assert float(sums.objective) / denom == pytest.approx(expected_loss, abs=1e-12)
    assert logp.grad.flatten().tolist() == pytest.approx(sum(expected_grad, []), abs=1e-12)
    metrics = step_metrics(sums.detached(), aggregation)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)  # one token clipped on each side
    assert metrics["pg_loss"] == pytest.approx(1.52 / 5)


def test_recompute_means_ratio_one():
    """Without old log-probs the behaviour policy is the current one: loss -A per token, no clipping."""
    logp, _, adv, mask, starts = _batch()
    sums = grpo_token_loss(logp, advantages=adv, loss_mask=mask, weights=torch.ones_like(adv), clip_low=CLIP_LOW,
                           clip_high=CLIP_HIGH, sequence_starts=starts)
    assert float(sums.objective) == pytest.approx(-2 + 3)
    assert float(sums.clipped) == 0


def test_k3_kl_penalty_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    ref = torch.log(torch.tensor([0.25, 0.5], dtype=torch.float64))
    # d = log(0.25 / 0.5) = -log 2: exp(d) - d - 1 = 0.5 + log 2 - 1
    assert k3_kl(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-12)
    sums = grpo_token_loss(logp, advantages=torch.zeros(2), loss_mask=torch.ones(2), weights=torch.ones(2),
                           clip_low=CLIP_LOW, clip_high=CLIP_HIGH, ref_logprobs=ref, kl_coef=0.1)
    assert float(sums.objective) == pytest.approx(0.1 * (0.5 + math.log(2) - 1), abs=1e-12)
    assert float(sums.kl) == pytest.approx(0.5 + math.log(2) - 1, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_token_loss(logp, advantages=torch.zeros(2), loss_mask=torch.ones(2), weights=torch.ones(2),
                        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=0.1)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_sums_split_anywhere_then_normalised_globally(aggregation):
    """Per-micro-batch sums added up and divided by the global count equal the whole-batch loss."""
    logp, old, adv, mask, starts = _batch()
    w = token_weights([2, 3], aggregation)
    weights = torch.tensor([[w[0]] * 3, [w[1]] * 3], dtype=torch.float64)
    kw = dict(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)

    def part(rows):
        return grpo_token_loss(logp[rows], advantages=adv[rows], loss_mask=mask[rows], weights=weights[rows],
                               old_logprobs=old[rows], sequence_starts=starts[rows], **kw).detached()

    whole, split = part([0, 1]), part([1]) + part([0])
    roundtrip = LossSums.from_vectors(*split.as_vectors())
    assert step_metrics(roundtrip, aggregation) == pytest.approx(step_metrics(whole, aggregation), nan_ok=True)


def _with_sync_check(logp: torch.Tensor, rollout: torch.Tensor) -> LossSums:
    """One sequence's loss sums with the weight-sync check filled as the trainer fills it (mismatch.py)."""
    n = logp.numel()
    sums = grpo_token_loss(logp, advantages=torch.ones(n), loss_mask=torch.ones(n), weights=torch.ones(n),
                           clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    gap = mismatch.measure(logp, rollout.double(), loss_mask=torch.ones(n), sequence_starts=torch.eye(1, n)[0],
                           sequence_index=torch.zeros(n, dtype=torch.long), num_sequences=1)
    sums.logprob_mismatch, sums.logprob_mismatch_max, sums.mismatch_tokens = mismatch.sync_check(gap)
    return sums


def test_mismatch_metric_ignores_missing_engine_logprobs():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    rollout = torch.tensor([-1.5, float("nan"), -2.0])
    sums = _with_sync_check(logp, rollout)
    metrics = step_metrics(sums.detached(), "token_mean")
    assert metrics["logprob_mismatch"] == pytest.approx(0.75)
    assert metrics["logprob_mismatch_max"] == pytest.approx(1.0)  # the third token's, not the missing one's


def test_mismatch_maximum_survives_summing_micro_batches():
    """The sync check asserts the largest per-token gap: adding micro-batches keeps the maximum."""
    def part(logp, rollout):
        return _with_sync_check(torch.tensor(logp), torch.tensor(rollout)).detached()

    total = part([-1.0, -2.0], [-1.0, -2.5]) + part([-1.0, -1.0], [-1.1, -1.0])
    sums, maxima = total.as_vectors()
    metrics = step_metrics(LossSums.from_vectors(sums, maxima), "token_mean")
    print("mean", metrics["logprob_mismatch"], "max", metrics["logprob_mismatch_max"])
    assert metrics["logprob_mismatch_max"] == pytest.approx(0.5)
    assert metrics["logprob_mismatch"] == pytest.approx(0.6 / 4)


def test_bad_aggregation_is_refused():
    with pytest.raises(ValueError, match="token_mean"):
        token_weights([1], "mean")


def _three_tokens(log_ratios, advantages):
    logp = torch.tensor(log_ratios, dtype=torch.float64).requires_grad_()
    return logp, torch.zeros(3, dtype=torch.float64), torch.tensor(advantages, dtype=torch.float64)


@pytest.mark.parametrize("clip_ratio_c,expected_loss,expected_grad,dual_frac", [
    # A = [-1, -1, +1], r = [5, 2, 5]: max(-A r, -A clip(r)) = [5, 2, -1.28]; the dual clip caps the first at
    # -A * 3 = 3 (no gradient there); r = 2 stays under the cap; A > 0 is never dual-clipped
    (3.0, [3.0, 2.0, -1.28], [0.0, 2.0, 0.0], 1 / 3),
    (None, [5.0, 2.0, -1.28], [5.0, 2.0, 0.0], 0.0),
])
def test_dual_clip_caps_negative_advantage_tokens(clip_ratio_c, expected_loss, expected_grad, dual_frac):
    logp, old, adv = _three_tokens([math.log(5.0), math.log(2.0), math.log(5.0)], [-1.0, -1.0, 1.0])
    per_token = []
    for i in range(3):  # one token at a time gives the per-token losses
        one = torch.zeros(3, dtype=torch.float64)
        one[i] = 1.0
        per_token.append(float(grpo_token_loss(logp.detach(), advantages=adv, loss_mask=one, weights=one,
                                               clip_low=CLIP_LOW, clip_high=CLIP_HIGH, clip_ratio_c=clip_ratio_c,
                                               old_logprobs=old).objective))
    sums = grpo_token_loss(logp, advantages=adv, loss_mask=torch.ones(3), weights=torch.ones(3, dtype=torch.float64),
                           clip_low=CLIP_LOW, clip_high=CLIP_HIGH, clip_ratio_c=clip_ratio_c, old_logprobs=old)
    sums.objective.backward()
    metrics = step_metrics(sums.detached(), "token_mean")
    print(f"clip_ratio_c={clip_ratio_c}: per-token loss {per_token}, grad {logp.grad.tolist()}, "
          f"dual_clip_frac {metrics['dual_clip_frac']}, clip_frac {metrics['clip_frac']}")
    assert per_token == pytest.approx(expected_loss, abs=1e-12)
    assert logp.grad.tolist() == pytest.approx(expected_grad, abs=1e-12)
    assert metrics["dual_clip_frac"] == pytest.approx(dual_frac)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)  # only the A > 0 token at r = 5 is clipped at 1.28


def test_log_ratio_is_clamped_before_exp():
    """log(pi/pi_old) = 40 with A = -1: the ratio is exp(20), not exp(40), and the clamped token has no gradient."""
    logp, old, adv = _three_tokens([40.0, 0.0, 0.0], [-1.0, 0.0, 0.0])
    sums = grpo_token_loss(logp, advantages=adv, loss_mask=torch.tensor([1.0, 0.0, 0.0]),
                           weights=torch.ones(3, dtype=torch.float64), clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                           old_logprobs=old)
    sums.objective.backward()
    print(f"log-ratio 40, A=-1: loss {float(sums.objective):.6g} (exp(20) = {math.exp(20):.6g}, "
          f"exp(40) = {math.exp(40):.6g}), grad {logp.grad.tolist()}")
    assert float(sums.objective) == pytest.approx(math.exp(20.0), rel=1e-12)
    assert logp.grad.tolist() == [0.0, 0.0, 0.0]


def test_k3_kl_is_clamped():
    """ref - logp = +30 and -30: d is clamped to +-20, then the k3 value to 10 (unclamped: 1.07e13 and 29)."""
    logp = torch.tensor([-31.0, 0.0, -1.0], dtype=torch.float64).requires_grad_()
    ref = torch.tensor([-1.0, -30.0, -1.0], dtype=torch.float64)
    kl = k3_kl(logp.detach(), ref)
    sums = grpo_token_loss(logp, advantages=torch.zeros(3), loss_mask=torch.ones(3),
                           weights=torch.ones(3, dtype=torch.float64), clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                           ref_logprobs=ref, kl_coef=0.1)
    sums.objective.backward()
    print(f"k3 at gaps +30, -30, 0: {kl.tolist()}; objective {float(sums.objective)}, grad {logp.grad.tolist()}")
    assert kl.tolist() == [10.0, 10.0, 0.0]
    assert float(sums.objective) == pytest.approx(0.1 * 20.0, abs=1e-12)
    assert float(sums.kl) == pytest.approx(20.0, abs=1e-12)
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)


@pytest.mark.parametrize("value", [1.0, 0.5, -3.0])
def test_clip_ratio_c_at_most_one_is_refused(value):
    with pytest.raises(ConfigError, match=rf"x.yaml: trainer.clip_ratio_c must be > 1 .* got {value}"):
        build(TrainerConfig, {"clip_ratio_c": value}, where="trainer", source="x.yaml")


def test_clip_ratio_c_is_off_unless_set():
    assert build(TrainerConfig, {}, where="trainer", source="x.yaml").clip_ratio_c is None
    assert build(TrainerConfig, {"clip_ratio_c": None}, where="trainer", source="x.yaml").clip_ratio_c is None
    assert build(TrainerConfig, {"clip_ratio_c": 3}, where="trainer", source="x.yaml").clip_ratio_c == 3.0
