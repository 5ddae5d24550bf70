"""Per-token log-probabilities and entropy from vocab-parallel logits.

The model's output layer is column-parallel over the padded vocabulary: TP rank
r holds logits for token ids ``[r*V_local, (r+1)*V_local)``. The softmax is
taken over the real vocabulary only (ids >= ``vocab_size`` are padding and get
no probability), with max / sum reductions over ``tp_group``. Results are
identical on every TP rank and differentiable: the all-reduces use Megatron's
autograd-aware ``reduce_from_tensor_model_parallel_region`` (identity in
backward), so the loss built from them must be the same on every TP rank, as in
Megatron's own cross entropy. Everything is computed in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


@dataclass(frozen=True)
class _Normalizer:
    logits: torch.Tensor  # fp32 local shard, padding columns at the fp32 minimum
    max: torch.Tensor  # global max over the vocabulary (no gradient: a shift only)
    lse: torch.Tensor  # global log-sum-exp
    vocab_start: int


def _normalize(logits: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int) -> _Normalizer:
    local_vocab = logits.shape[-1]
    start = tp_group.rank() * local_vocab
    if not 0 < vocab_size <= local_vocab * tp_group.size():
        raise ValueError(f"vocab_size={vocab_size} does not fit logits of {local_vocab} columns "
                         f"x {tp_group.size()} TP ranks")
    z = logits.float()
    padding = torch.arange(start, start + local_vocab, device=z.device) >= vocab_size
    if padding.any():
        # The minimum (not -inf) keeps p * z at 0 for padding columns in the entropy.
        z = z.masked_fill(padding, torch.finfo(z.dtype).min)
    z_max = z.detach().amax(dim=-1)
    if tp_group.size() > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
    sum_exp = reduce_from_tensor_model_parallel_region((z - z_max.unsqueeze(-1)).exp().sum(-1), tp_group)
    return _Normalizer(z, z_max, z_max + sum_exp.log(), start)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup, *,
                   vocab_size: int) -> torch.Tensor:
    """log p(labels) under ``softmax(logits)``; logits ``[..., V_local]``, labels ``[...]`` -> ``[...]``.

    ``vocab_size`` is the real (HF) vocabulary size; labels must be below it.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    norm = _normalize(logits, tp_group, vocab_size)
    local = labels - norm.vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    picked = norm.logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    label_logit = reduce_from_tensor_model_parallel_region(torch.where(here, picked, 0.0), tp_group)
    return label_logit - norm.lse


def token_entropy(logits: torch.Tensor, tp_group: dist.ProcessGroup, *, vocab_size: int) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the real vocabulary; ``[..., V_local]`` -> ``[...]``."""
    norm = _normalize(logits, tp_group, vocab_size)
    probs = (norm.logits - norm.lse.unsqueeze(-1)).exp()
    expected_logit = reduce_from_tensor_model_parallel_region((probs * norm.logits).sum(-1), tp_group)
    return norm.lse - expected_logit
