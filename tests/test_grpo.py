"""GRPO objective against hand-computed numbers (clipping on both sides, both aggregations)."""
from __future__ import annotations

import math

import pytest
import torch

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
    roundtrip = LossSums.from_vector(split.as_vector())
    assert step_metrics(roundtrip, aggregation) == pytest.approx(step_metrics(whole, aggregation), nan_ok=True)


def test_mismatch_metric_ignores_missing_engine_logprobs():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    rollout = torch.tensor([-1.5, float("nan"), -2.0])
    sums = grpo_token_loss(logp, advantages=torch.ones(3), loss_mask=torch.ones(3), weights=torch.ones(3),
                           clip_low=CLIP_LOW, clip_high=CLIP_HIGH, rollout_logprobs=rollout)
    assert step_metrics(sums.detached(), "token_mean")["logprob_mismatch"] == pytest.approx(0.75)


def test_bad_aggregation_is_refused():
    with pytest.raises(ValueError, match="token_mean"):
        token_weights([1], "mean")
