"""Our mismatch corrections and diagnostics against veRL's and slime's own functions on one shared
random batch (tests/peers: their code transcribed with file:line citations at pinned commits, and
checked equal to the real files when it was written).

Where the peers disagree with each other the test says which one we follow and checks the
difference is what we say it is, rather than hiding it in a tolerance.
"""
from __future__ import annotations

import pytest
import torch

from rollpacker.trainer import mismatch
from rollpacker.trainer.backend import policy_loss
from rollpacker.trainer.config import MismatchConfig, TrainerConfig
from rollpacker.trainer.grpo import denominator
from rollpacker.trainer.packing import MicroBatch
from tests.peers import slime, verl

B, T = 6, 40


def batch(seed: int = 0, *, far_row: int | None = 2):
    """Right-padded [B, T] log-probs: the engine's are the trainer's plus noise, one row far off."""
    gen = torch.Generator().manual_seed(seed)
    train = -torch.randn(B, T, generator=gen, dtype=torch.float64).abs() * 1.5
    rollout = train + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    if far_row is not None:
        rollout[far_row] -= 1.0
    lengths = torch.randint(T // 4, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    advantages = torch.randn(B, generator=gen, dtype=torch.float64)
    return train * mask, rollout * mask, mask, advantages


def ours(train, rollout, mask, cfg: MismatchConfig):
    """Our gap over the [B, T] batch, one row per response."""
    starts = torch.zeros_like(mask)
    starts[:, 0] = 1.0
    seq = torch.arange(B)[:, None].expand(B, T)
    gap = mismatch.measure(train, torch.where(mask > 0, rollout, torch.nan), loss_mask=mask, sequence_index=seq,
                           sequence_starts=starts, num_sequences=B)
    return gap


def rows(flat: torch.Tensor) -> torch.Tensor:
    return flat.reshape(B, T)


LEVELS = ["token", "sequence", "geometric"]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_weights_equal_verl_head_and_slime(level):
    train, rollout, mask, _ = batch()
    fix = mismatch.correct(ours(train, rollout, mask, MismatchConfig()), MismatchConfig(correct=level, high=2.0))
    verl_w = verl.verl_is_weights(train, rollout, mask, level=level, threshold=2.0)
    slime_w, slime_mask, _ = slime.slime_mis(train, rollout, mask, level=level, mode="truncate", upper=2.0)
    print(f"{level}: max |ours - veRL| {float((rows(fix.weights) - verl_w).abs().max()):.2e}, "
          f"max |ours - slime| {float((rows(fix.weights) - slime_w).abs().max()):.2e}")
    assert torch.allclose(rows(fix.weights), verl_w, rtol=1e-12, atol=0)
    assert torch.allclose(rows(fix.weights), slime_w, rtol=1e-12, atol=0)
    assert torch.equal(rows(fix.keep), mask) and torch.equal(slime_mask, mask)
    if level == "token":  # slime's vanilla TIS (its default correction): the same weights
        assert torch.allclose(rows(fix.weights), slime.slime_tis(train, rollout) * mask, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", LEVELS)
def test_every_level_and_mode_equals_verl_3915_and_slime_mis(level, mode):
    train, rollout, mask, _ = batch(1)
    # bounds the batch straddles at every level: some tokens and rows kept, some not
    high = {"token": 1.3, "sequence": 2.0, "geometric": 1.05}[level]
    fix = mismatch.correct(ours(train, rollout, mask, MismatchConfig()),
                           MismatchConfig(correct=level, mode=mode, high=high))
    v_w, v_mask, _ = verl.verl3915_weights(train, rollout, mask, level=level, mode=mode, upper=high)
    s_w, s_mask, _ = slime.slime_mis(train, rollout, mask, level=level, mode=mode, upper=high)
    # both leave a rejected token's weight in place (their mask drops the token); ours is 0 there
    v_w, s_w = v_w.detach() * v_mask, s_w * s_mask
    # geometric: veRL #3915 divides a row's sum by n + 1e-8, slime and we by n
    tol = 1e-7 if level == "geometric" else 1e-12
    kept = float(fix.keep.sum()) / float(mask.sum())
    print(f"{level}/{mode} high {high}: kept {kept:.3f}, max |ours - veRL#3915| "
          f"{float((rows(fix.weights) - v_w).abs().max()):.2e}, max |ours - slime| "
          f"{float((rows(fix.weights) - s_w).abs().max()):.2e}")
    assert torch.equal(rows(fix.keep), v_mask) and torch.equal(rows(fix.keep), s_mask)
    assert torch.allclose(rows(fix.weights), v_w, rtol=tol, atol=0)
    assert torch.allclose(rows(fix.weights), s_w, rtol=1e-12, atol=0)
    if mode == "mask":
        assert 0 < kept < 1


def test_token_mask_equals_verl_heads_k1_rejection():
    train, rollout, mask, _ = batch(2)
    fix = mismatch.correct(ours(train, rollout, mask, MismatchConfig()),
                           MismatchConfig(correct="token", mode="mask", high=1.5))
    verl_mask = verl.verl_rejection_mask(train, rollout, mask, rollout_rs="token_k1", rollout_rs_threshold=1.5)
    assert torch.equal(rows(fix.keep), verl_mask)


def test_diagnostics_equal_verl_heads_off_policy_metrics():
    train, rollout, mask, _ = batch(3)
    cfg = MismatchConfig()
    gap = ours(train, rollout, mask, cfg)
    m = mismatch.metrics(mismatch.diagnostics(gap, cfg), cfg)
    v = verl.verl_offpolicy_metrics(train, rollout, mask)
    pairs = {"kl_k1": "kl", "kl_k3": "k3_kl", "training_ppl": "training_ppl", "rollout_ppl": "rollout_ppl",
             "log_ppl_diff": "log_ppl_diff", "ppl_ratio": "ppl_ratio", "chi2_token": "chi2_token",
             "chi2_seq": "chi2_seq"}
    for key, theirs in pairs.items():
        print(f"{key}: ours {m[key]:.10g}, veRL {theirs} {v[theirs]:.10g}")
        # veRL's masked mean divides by n + 1e-8
        assert m[key] == pytest.approx(v[theirs], rel=1e-7, abs=1e-12), key


def _our_step_loss(train, rollout, mask, advantages, cfg: TrainerConfig) -> float:
    """Our policy loss of the batch as one micro-batch (the trainer's path from log-probs on), divided
    by the step's denominator: at ratio 1 each kept token contributes -A * w."""
    starts = torch.zeros_like(mask)
    starts[:, 0] = 1.0
    lengths = mask.sum(1, keepdim=True)
    weights = (1.0 / lengths).expand(B, T) if cfg.loss_aggregation == "seq_mean" else torch.ones(B, T)
    zeros = torch.zeros(B, T, dtype=torch.long)
    mb = MicroBatch(input_ids=zeros, position_ids=zeros, labels=zeros, loss_mask=mask,
                    advantages=advantages[:, None].expand(B, T), weights=weights.to(torch.float64),
                    rollout_logprobs=torch.where(mask > 0, rollout, torch.nan), sequence_starts=starts,
                    sequence_index=torch.arange(B)[:, None].expand(B, T), real=torch.ones(B, T, dtype=torch.bool),
                    layout="padded", cu_seqlens=None,
                    cu_seqlens_unpadded=None, max_seqlen=T, num_tokens=int(mask.sum()), num_sequences=B)
    objective, sums = policy_loss(mb, train, cfg=cfg)
    return float(objective) / denominator(int(sums.tokens), int(sums.sequences), cfg.loss_aggregation)


def _peer_per_token_loss(train, rollout, mask, advantages, high):
    w, new_mask, _ = verl.verl3915_weights(train, rollout, mask, level="token", mode="mask", upper=high)
    return -advantages[:, None] * w.detach(), new_mask


def test_rejected_tokens_leave_the_denominator_as_in_verl_and_slime_657():
    train, rollout, mask, adv = batch(4, far_row=None)
    high = 1.3
    loss, new_mask = _peer_per_token_loss(train, rollout, mask, adv, high)
    assert bool((new_mask.sum(1) > 0).all())  # no response wholly rejected: the peers agree here
    mm = MismatchConfig(correct="token", mode="mask", high=high)
    token_mean = _our_step_loss(train, rollout, mask, adv, TrainerConfig(mismatch=mm))
    seq_mean = _our_step_loss(train, rollout, mask, adv, TrainerConfig(mismatch=mm, loss_aggregation="seq_mean"))
    verl_token = float(verl.verl_agg_loss(loss, new_mask, "token-mean"))
    verl_seq = float(verl.verl_agg_loss(loss, new_mask, "seq-mean-token-mean"))
    slime_657, _ = slime.slime_657_sample_mean_loss(loss, mask, new_mask)
    slime_head, _ = slime.slime_head_sample_mean_loss(loss, mask, new_mask)
    print(f"token_mean: ours {token_mean:.10f} veRL {verl_token:.10f}; seq_mean: ours {seq_mean:.10f} "
          f"veRL {verl_seq:.10f} slime#657 {float(slime_657):.10f} (slime HEAD, rejected tokens kept in the "
          f"denominator: {float(slime_head):.10f})")
    assert token_mean == pytest.approx(verl_token, rel=1e-12)
    assert seq_mean == pytest.approx(verl_seq, rel=1e-8) and seq_mean == pytest.approx(float(slime_657), rel=1e-12)
    assert abs(seq_mean - float(slime_head)) > 1e-3  # slime #1933 went back to the original lengths


def test_a_wholly_rejected_response_leaves_the_count_as_in_verl_not_slime_657():
    """With a response whose every token is rejected, veRL drops it from the sequence count and slime
    #657 still divides by the batch's response count; we follow veRL (it was not sampled, as far as
    the loss is concerned)."""
    train, rollout, mask, adv = batch(5, far_row=None)
    rollout[0] = train[0] - 3.0  # every token of response 0: w = e^3 > high
    loss, new_mask = _peer_per_token_loss(train, rollout, mask, adv, 1.5)
    assert float(new_mask[0].sum()) == 0 and bool((new_mask[1:].sum(1) > 0).all())
    cfg = TrainerConfig(loss_aggregation="seq_mean", mismatch=MismatchConfig(correct="token", mode="mask", high=1.5))
    seq_mean = _our_step_loss(train, rollout, mask, adv, cfg)
    verl_seq = float(verl.verl_agg_loss(loss, new_mask, "seq-mean-token-mean"))
    slime_657, _ = slime.slime_657_sample_mean_loss(loss, mask, new_mask)
    assert seq_mean == pytest.approx(verl_seq, rel=1e-8)
    assert seq_mean == pytest.approx(float(slime_657) * B / (B - 1), rel=1e-12)
