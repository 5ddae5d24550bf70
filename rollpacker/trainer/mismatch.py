"""The gap between the rollout engine's policy and the trainer's: measured every step, corrected on request.

The engine samples each response token with its own numerics (bf16 weights, its own kernels and
reduction orders); the trainer recomputes that token's log-prob with its own. Meant to be one
policy, they are not exactly, and long responses accumulate the difference. Per token the gap is
``log r = log pi_train - log pi_rollout``, clamped to [-20, 20] as veRL's rollout correction does,
taken from the trainer's forward before the update (one optimizer step per batch: the weights the
engine was synced with).

**Diagnostics**, every step, from the tokens that have an engine log-prob (the sampling policy is the
engine's, so these are expectations under it): KL(rollout || train) as k1 (mean of ``-log r``) and
k3 (mean of ``r - log r - 1``); each response's perplexity under either policy and their ratio;
chi-square at token level (``mean r^2 - 1``) and at sequence level (``mean over responses of
(prod r)^2 - 1``); the share of tokens and responses whose weight is above ``high`` or below the
lower bound. Each also per response-length bucket; the caller adds the round kind.

**Corrections** (``trainer.mismatch.correct``): an importance weight ``w`` on each token's
policy-gradient term, from detached log-probs, so no gradient flows through it:

* ``token``: ``w_t = r_t``;
* ``sequence``: ``w = prod_t r_t`` on every token of the response (its log clamped to [-20, 20]);
* ``geometric``: ``w = exp(mean_t log r_t)`` on every token: a per-token scale that does not grow
  with the response's length.

``mode: truncate`` clamps ``w`` to ``[low, high]`` (``low`` 0 unless set: an upper cap, as veRL's
truncated IS and slime's TIS). ``mode: mask`` keeps ``w`` where ``low <= w <= high`` (``low``
``1/high`` unless set) and rejects the token, at sequence levels the whole response, elsewhere: a
rejected token leaves the loss and its denominator, the global token count (``token_mean``) or its
response's length (``seq_mean``; a response with nothing left leaves the sequence count).

Context parallelism cuts every response over ranks, so every per-response sum is added over the
context-parallel group (``reduce``) before anything nonlinear is taken of it; a response's own
statistics are counted on the rank that holds its first token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rollpacker.trainer.config import MismatchConfig
from rollpacker.trainer.grpo import LOG_RATIO_BOUND  # veRL's rollout_corr_helper.py SAFETY_BOUND too

# The additive statistics of one response-length bucket, in the order of the diagnostics matrix's columns.
STATS = ("tokens", "k1", "k3", "r2", "tokens_above", "tokens_below",
         "sequences", "training_ppl", "rollout_ppl", "log_ppl_diff", "ppl_ratio", "seq_r2", "seqs_above",
         "seqs_below")
_COL = {name: i for i, name in enumerate(STATS)}

# Columns of a micro-batch's per-response sums.
_RESPONSE, _HAVE, _LOG_R, _TRAIN, _ROLLOUT = range(5)


Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Gap:
    """The engine-trainer gap on one micro-batch's (or one context-parallel shard's) tokens."""

    log_ratio: torch.Tensor  # flat, per token: train - rollout clamped; 0 off ``have``
    diff: torch.Tensor  # flat, per token: train - rollout unclamped; 0 off ``have``
    have: torch.Tensor  # flat float: a loss token with an engine log-prob
    mask: torch.Tensor  # flat float: the loss mask
    starts: torch.Tensor  # flat float: 1 on each response's first token
    seq: torch.Tensor  # flat long: each token's response, an index into ``per_seq``
    per_seq: torch.Tensor  # [responses, 5], summed over every shard: see _RESPONSE.._ROLLOUT
    owner: torch.Tensor  # [responses] 1 where this shard holds the response's first token
    reduce: Reduce | None

    def sum_per_response(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values`` [t, k] summed per response over every shard: [responses, k]."""
        return _sum_per_response(values, self.seq, self.per_seq.shape[0], self.reduce)


def _sum_per_response(values: torch.Tensor, seq: torch.Tensor, responses: int, reduce: Reduce | None) -> torch.Tensor:
    out = torch.zeros(responses, values.shape[1], dtype=torch.float64, device=values.device)
    out.index_add_(0, seq, values.to(torch.float64))
    return reduce(out) if reduce is not None else out


def measure(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *, loss_mask: torch.Tensor,
            sequence_index: torch.Tensor, sequence_starts: torch.Tensor, num_sequences: int,
            reduce: Reduce | None = None) -> Gap:
    """The gap of each token, and each response's sums. ``rollout_logprobs`` is NaN where the engine
    gave none; ``reduce`` adds a tensor over the context-parallel group (None: one shard)."""
    train = train_logprobs.detach().reshape(-1).to(torch.float64)
    rollout = rollout_logprobs.reshape(-1).to(torch.float64)
    mask = loss_mask.reshape(-1).to(torch.float64)
    have = mask * (~torch.isnan(rollout)).to(torch.float64)
    rollout = torch.nan_to_num(rollout, nan=0.0)
    diff = (train - rollout) * have
    starts = sequence_starts.reshape(-1).to(torch.float64)
    seq = sequence_index.reshape(-1).to(torch.long)
    log_ratio = torch.clamp(diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    per_seq = _sum_per_response(torch.stack([mask, have, log_ratio, train * have, rollout * have], 1), seq,
                                num_sequences, reduce)
    owner = torch.zeros(num_sequences, dtype=torch.float64, device=train.device).index_add_(0, seq, starts)
    return Gap(log_ratio=log_ratio, diff=diff, have=have, mask=mask, starts=starts, seq=seq, per_seq=per_seq,
               owner=owner, reduce=reduce)


@dataclass
class Correction:
    """Per-token importance weights and the tokens the correction keeps (flat, detached)."""

    weights: torch.Tensor
    keep: torch.Tensor  # float: the loss mask without the rejected tokens


def correct(gap: Gap, cfg: MismatchConfig) -> Correction:
    """The importance weight of every token under ``cfg`` (which must not be ``off``)."""
    if bool((gap.mask > gap.have).any()):
        raise ValueError("trainer.mismatch.correct needs the engine's log-prob of every response token, and some "
                         "have none; make the engine return log-probs or set trainer.mismatch.correct=off")
    if cfg.correct == "token":
        log_w = gap.log_ratio
    else:
        sums, counts = gap.per_seq[:, _LOG_R], gap.per_seq[:, _HAVE].clamp(min=1.0)
        per_response = (torch.clamp(sums, -LOG_RATIO_BOUND, LOG_RATIO_BOUND) if cfg.correct == "sequence"
                        else sums / counts)
        log_w = per_response[gap.seq]
    w = torch.exp(log_w)
    if cfg.mode == "truncate":
        return Correction(weights=w.clamp(min=cfg.lower, max=cfg.high) * gap.mask, keep=gap.mask)
    inside = ((w >= cfg.lower) & (w <= cfg.high)).to(torch.float64)
    return Correction(weights=w * inside * gap.mask, keep=gap.mask * inside)


def kept_responses(gap: Gap, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's response length after rejection, 1 on the first token of each response with a
    token left): what ``seq_mean`` divides by, and the sequence count."""
    kept_len = gap.sum_per_response(keep.unsqueeze(1))[:, 0]
    return kept_len[gap.seq], gap.starts * (kept_len > 0).to(torch.float64)[gap.seq]


def sync_check(gap: Gap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, largest, count) of ``|logp - rollout|`` over every response token with an engine log-prob,
    rejected by a correction or not: the weight-sync check (``train/logprob_mismatch``, ``_max``)."""
    diff = gap.diff.abs()
    return diff.sum(), diff.max() if diff.numel() else diff.new_zeros(()), gap.have.sum()


def diagnostics(gap: Gap, cfg: MismatchConfig) -> torch.Tensor:
    """The additive statistics (``STATS``) of this shard per response-length bucket: [buckets, len(STATS)]."""
    edges = torch.tensor(cfg.length_buckets, dtype=torch.float64, device=gap.per_seq.device)
    bucket_of_seq = torch.bucketize(gap.per_seq[:, _RESPONSE].contiguous(), edges, right=True)
    out = torch.zeros(len(cfg.length_buckets) + 1, len(STATS), dtype=torch.float64, device=gap.per_seq.device)

    lr, have = gap.log_ratio, gap.have
    r = torch.exp(lr)
    per_token = torch.stack([have, -gap.diff, (r - lr - 1.0) * have, r * r * have,
                             (r > cfg.high).to(torch.float64) * have,
                             (r < cfg.share_low).to(torch.float64) * have], 1)
    out[:, :per_token.shape[1]].index_add_(0, bucket_of_seq[gap.seq], per_token)

    n = gap.per_seq[:, _HAVE]
    counted = gap.owner * (n > 0).to(torch.float64)  # once per response, where it has engine log-probs
    n = n.clamp(min=1.0)
    mean_train, mean_rollout = gap.per_seq[:, _TRAIN] / n, gap.per_seq[:, _ROLLOUT] / n
    seq_r = torch.exp(torch.clamp(gap.per_seq[:, _LOG_R], -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    per_seq = torch.stack([torch.ones_like(n), torch.exp(-mean_train), torch.exp(-mean_rollout),
                           mean_rollout - mean_train, torch.exp(mean_rollout - mean_train), seq_r * seq_r,
                           (seq_r > cfg.high).to(torch.float64), (seq_r < cfg.share_low).to(torch.float64)], 1)
    out[:, per_token.shape[1]:].index_add_(0, bucket_of_seq, per_seq * counted.unsqueeze(1))
    return out


def metrics(matrix: torch.Tensor, cfg: MismatchConfig) -> dict[str, float]:
    """The step's diagnostics from its globally summed matrix, overall and per length bucket
    (a bucket without tokens is left out; all of them when the engine gave no log-probs)."""
    out = _means(matrix.sum(0))
    for name, row in zip(cfg.bucket_names(), matrix):
        if row[_COL["tokens"]] > 0:
            out.update({f"{name}/{k}": v for k, v in _means(row).items()})
    return out


def _means(row: torch.Tensor) -> dict[str, float]:
    s = dict(zip(STATS, row.tolist()))
    tokens, seqs = s["tokens"], s["sequences"]
    if tokens <= 0:
        return {}
    out = {"tokens": int(tokens), "kl_k1": s["k1"] / tokens, "kl_k3": s["k3"] / tokens,
           "chi2_token": s["r2"] / tokens - 1.0, "tokens_above": s["tokens_above"] / tokens,
           "tokens_below": s["tokens_below"] / tokens}
    if seqs > 0:
        out.update({"sequences": int(seqs), "training_ppl": s["training_ppl"] / seqs,
                    "rollout_ppl": s["rollout_ppl"] / seqs, "log_ppl_diff": s["log_ppl_diff"] / seqs,
                    "ppl_ratio": s["ppl_ratio"] / seqs, "chi2_seq": s["seq_r2"] / seqs - 1.0,
                    "seqs_above": s["seqs_above"] / seqs, "seqs_below": s["seqs_below"] / seqs})
    return out
