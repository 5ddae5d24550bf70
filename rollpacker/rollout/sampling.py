"""Batched per-row sampling with per-request randomness.

Each request brings its own uniform draws (from its own ``torch.Generator``,
drawn once at submission), so the token a request samples at step ``n``
depends only on its seed and its logits, never on which other requests share
the batch. Sampling is inverse-CDF on the filtered distribution, one uniform
per token.

Log-probs are those of the sampled token under the temperature-1, unfiltered
model distribution: that is exactly what the trainer recomputes for the
policy ratio, so rollout and training log-probs are directly comparable.
"""
from __future__ import annotations

import torch


def draw_uniforms(seed: int, count: int) -> torch.Tensor:
    """The ``count`` uniforms a request with ``seed`` uses, one per generated token."""
    return torch.rand(count, generator=torch.Generator().manual_seed(seed))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; return ``(tokens [B], logprobs [B])``.

    ``temperature == 0`` rows are greedy; ``top_k == -1`` and ``top_p == 1`` disable the cuts.
    Rows with and without cuts are drawn in two separate vectorized groups, so the path a
    row takes (sorted or vocabulary order) depends on its own parameters only.
    """
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    sampled = temperature > 0
    cut = sampled & ((top_k > 0) | (top_p < 1))
    for group, with_cuts in ((cut, True), (sampled & ~cut, False)):
        rows = group.nonzero().squeeze(1)
        if rows.numel():
            scaled = logits[rows] / temperature[rows].unsqueeze(1)
            tokens[rows] = _draw(scaled, top_p[rows], top_k[rows], uniforms[rows]) if with_cuts else \
                _inverse_cdf(torch.softmax(scaled, dim=-1), uniforms[rows])
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)


def _draw(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p (the smallest prefix reaching ``top_p``), on probabilities sorted descending."""
    scaled, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(scaled, dim=-1)
    rank = torch.arange(probs.shape[1], device=probs.device)
    drop = (top_k.unsqueeze(1) > 0) & (rank >= top_k.unsqueeze(1))
    drop |= (top_p.unsqueeze(1) < 1) & ((probs.cumsum(-1) - probs) >= top_p.unsqueeze(1))
    choice = _inverse_cdf(probs.masked_fill(drop, 0.0), uniforms)
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)
