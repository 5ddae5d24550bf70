"""The GRPO objective as pure tensor math (no Megatron, no process groups).

Aggregation is split in two so that one optimizer step can be assembled from
any number of micro-batches on any number of data-parallel ranks, in any
order (the stream trainer relies on this):

* each micro-batch contributes an *unnormalised sum* ``sum_t w_t * loss_t``,
  where the token weight ``w_t`` is 1 for ``token_mean`` and ``1/len(seq)``
  for ``seq_mean``;
* after every micro-batch of the step has been seen and the sums (and their
  gradients) have been added across ranks, the total is divided once by the
  step's global denominator: the number of response tokens (``token_mean``) or
  of sequences (``seq_mean``) in the loss, which leaves out what a mismatch
  correction rejected (``LossSums.tokens``, ``LossSums.sequences``).

Because differentiation is linear, dividing the summed gradient by the
denominator gives exactly the gradient of the normalised loss.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean"]

# Numerical guards, as veRL's: one token whose log-ratio ran away must not overflow exp or swamp the step.
LOG_RATIO_BOUND = 20.0  # veRL core_algos.py compute_policy_loss(_vanilla), kl_penalty: log-ratio clamped to [-20, 20]
K3_BOUND = 10.0  # veRL core_algos.py kl_penalty: low_var_kl clamped to [-10, 10]


def group_advantages(rewards: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of one prompt group: ``r - mean(r)``, optionally divided by ``std(r) + eps``.

    The std is the unbiased sample std, as in GRPO; a group of one response
    has no baseline to compare against and gets advantage 0.
    """
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards of one group must be a non-empty 1-D tensor, got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64)
    if rewards.numel() == 1:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()
    if std_normalize:
        centred = centred / (rewards.std(unbiased=True) + eps)
    return centred


def token_weights(response_lengths: list[int], aggregation: Aggregation) -> list[float]:
    """The per-token weight of each sequence: 1 (token mean) or 1/len (sequence mean)."""
    if aggregation == "token_mean":
        return [1.0] * len(response_lengths)
    if aggregation == "seq_mean":
        return [1.0 / n for n in response_lengths]
    raise ValueError(f"loss aggregation must be 'token_mean' or 'seq_mean', got {aggregation!r}")


def denominator(num_tokens: int, num_sequences: int, aggregation: Aggregation) -> int:
    """The global count a step's summed loss is divided by."""
    return num_tokens if aggregation == "token_mean" else num_sequences


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): ``exp(d) - d - 1`` with ``d = ref - logp`` (>= 0).

    ``d`` is clamped to [-20, 20] and the value to at most 10 (k3 >= 0, so veRL's lower bound -10
    never binds): one token far from the reference cannot swamp the step; its KL gradient is 0 there.
    """
    d = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(d) - d - 1.0, max=K3_BOUND)


@dataclass
class LossSums:
    """Unnormalised sums over the tokens of one or more micro-batches.

    ``objective`` carries the autograd graph (weighted by the aggregation
    weights); every other field is a detached per-token sum used for metrics,
    normalised by the token count at the end of the step.
    """

    objective: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor  # tokens whose loss the dual clip (clip_ratio_c) capped
    logprob_mismatch: torch.Tensor  # |logp - rollout logp|, over tokens that have a rollout logp
    logprob_mismatch_max: torch.Tensor  # the largest of those: a maximum, not a sum (MAX_FIELDS)
    mismatch_tokens: torch.Tensor
    tokens: torch.Tensor  # the loss's tokens: response tokens the mismatch correction did not reject
    sequences: torch.Tensor  # responses with a token in the loss
    is_weight: torch.Tensor  # the mismatch correction's importance weights, summed over the loss's tokens
    mismatch: torch.Tensor  # the engine-trainer gap's statistics per length bucket (mismatch.diagnostics)

    @classmethod
    def zeros(cls, device: torch.device | str = "cpu", mismatch_shape: tuple[int, ...] = ()) -> "LossSums":
        """All zero; ``mismatch`` of ``mismatch_shape`` (a scalar adds to any shape)."""
        return cls(**{f.name: torch.zeros(mismatch_shape if f.name == "mismatch" else (), dtype=torch.float64,
                                          device=device) for f in fields(cls)})

    def detached(self) -> "LossSums":
        return LossSums(**{f.name: getattr(self, f.name).detach().to(torch.float64) for f in fields(self)})

    def __add__(self, other: "LossSums") -> "LossSums":
        return LossSums(**{f.name: (torch.maximum if f.name in MAX_FIELDS else torch.add)(
            getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    def as_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, maxima): the fields as two float64 vectors, one all-reduced with SUM, one with MAX;
        the ``mismatch`` matrix flattened at the end of the first."""
        def stack(names: list[str]) -> torch.Tensor:
            return torch.stack([getattr(self, n).detach().to(torch.float64).reshape(()) for n in names])
        return torch.cat([stack(_SUMMED), self.mismatch.detach().to(torch.float64).reshape(-1)]), \
            stack(sorted(MAX_FIELDS))

    @classmethod
    def from_vectors(cls, sums: torch.Tensor, maxima: torch.Tensor,
                     mismatch_shape: tuple[int, ...] = ()) -> "LossSums":
        n = len(_SUMMED)
        return cls(**dict(zip(_SUMMED, sums[:n])), **dict(zip(sorted(MAX_FIELDS), maxima)),
                   mismatch=sums[n:].reshape(mismatch_shape))


MAX_FIELDS = frozenset({"logprob_mismatch_max"})
_SUMMED = [f.name for f in fields(LossSums) if f.name not in MAX_FIELDS | {"mismatch"}]


def grpo_token_loss(
    logprobs: torch.Tensor,
    *,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    sequence_starts: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossSums:
    """Clipped-surrogate GRPO loss summed over the tokens selected by ``loss_mask``.

    All tensors share one shape (any layout: padded ``[b, s]`` or packed
    ``[1, t]``). ``old_logprobs=None`` means the behaviour policy is the
    current weights (one optimizer step per batch), i.e. ``logprobs.detach()``:
    the ratio is 1 and its gradient ``-A * grad(logp)``.

    The per-token loss is ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``, with
    ``r = exp(clamp(logp - old, -20, 20))``; with ``clip_ratio_c`` set, a token with ``A < 0`` has
    that capped at ``-A * clip_ratio_c`` (dual clip: a huge ratio on a bad token no longer
    dominates, and the capped token has no gradient). Plus ``kl_coef * k3(logp, ref)``.
    ``is_weights`` (detached; the mismatch correction's) multiplies the policy-gradient term after
    the clip, as veRL's and slime's do. ``sequence_starts`` marks one token per sequence (its first
    response token), to count sequences. The engine-trainer gap's fields (``logprob_mismatch*``,
    ``mismatch_tokens``, ``mismatch``) are the caller's to fill (``mismatch.py``).
    """
    mask = loss_mask.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
    ratio = torch.exp(torch.clamp(logprobs - old, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    adv = advantages.to(logprobs.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if clip_ratio_c is not None:
        cap = -adv * clip_ratio_c
        dual = (adv < 0) & (per_token.detach() > cap)
        per_token = torch.where(dual, cap, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.reshape(per_token.shape).to(per_token.dtype)
    pg_sum = (per_token * mask).sum()
    kl_tok = torch.zeros_like(per_token)
    if kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl_tok = k3_kl(logprobs, ref_logprobs.to(logprobs.dtype))
        per_token = per_token + kl_coef * kl_tok
    objective = (per_token * weights.to(logprobs.dtype) * mask).sum()

    sums = LossSums.zeros(logprobs.device)
    sums.objective = objective
    sums.pg_loss = pg_sum.detach().double()
    sums.kl = (kl_tok.detach() * mask).sum().double()
    if entropy is not None:
        sums.entropy = (entropy.detach() * mask).sum().double()
    sums.clipped = ((clipped.detach() > unclipped.detach()).to(mask.dtype) * mask).sum().double()
    sums.dual_clipped = (dual.to(mask.dtype) * mask).sum().double()
    sums.tokens = mask.sum().double()
    sums.is_weight = sums.tokens if is_weights is None else (is_weights.reshape(mask.shape).double() * mask).sum()
    if sequence_starts is not None:
        sums.sequences = sequence_starts.to(torch.float64).sum()
    return sums


def step_metrics(sums: LossSums, aggregation: Aggregation) -> dict[str, float]:
    """Metrics of one step from its globally summed ``LossSums``."""
    tokens = max(float(sums.tokens), 1.0)
    denom = max(float(denominator(int(sums.tokens), int(sums.sequences), aggregation)), 1.0)
    mism = float(sums.mismatch_tokens)
    return {
        "loss": float(sums.objective) / denom,
        "pg_loss": float(sums.pg_loss) / tokens,
        "kl": float(sums.kl) / tokens,
        "entropy": float(sums.entropy) / tokens,
        "clip_frac": float(sums.clipped) / tokens,
        "dual_clip_frac": float(sums.dual_clipped) / tokens,
        "logprob_mismatch": float(sums.logprob_mismatch) / mism if mism > 0 else float("nan"),
        "logprob_mismatch_max": float(sums.logprob_mismatch_max) if mism > 0 else float("nan"),
        "tokens": int(sums.tokens),
        "sequences": int(sums.sequences),
    }
