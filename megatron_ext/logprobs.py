"""Per-token log-probabilities and entropy from vocab-parallel logits.

The model's output layer is column-parallel over the padded vocabulary: TP rank
r holds logits for token ids ``[r*V_local, (r+1)*V_local)``. The softmax is
taken over the real vocabulary only (ids >= ``vocab_size`` are padding and get
no probability), with max / sum reductions over ``tp_group``. Results are
identical on every TP rank and differentiable: the all-reduces use Megatron's
autograd-aware ``reduce_from_tensor_model_parallel_region`` (identity in
backward), so the loss built from them must be the same on every TP rank, as in
Megatron's own cross entropy, and every reduced value is used only in that
replicated part. Everything is computed in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


@dataclass(frozen=True)
class _Softmax:
    shifted: torch.Tensor  # fp32 local logits minus the global max; 0 on padding columns
    exp: torch.Tensor  # exp(shifted); 0 on padding columns
    sum_exp: torch.Tensor  # over the whole vocabulary (all TP ranks)
    vocab_start: int


def _softmax(logits: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int) -> _Softmax:
    local_vocab = logits.shape[-1]
    start = tp_group.rank() * local_vocab
    if not 0 < vocab_size <= local_vocab * tp_group.size():
        raise ValueError(f"vocab_size={vocab_size} does not fit logits of {local_vocab} columns "
                         f"x {tp_group.size()} TP ranks")
    z = logits.float()
    padding = torch.arange(start, start + local_vocab, device=z.device) >= vocab_size
    # The max is only a shift for stability: no gradient flows through it.
    z_max = z.detach().masked_fill(padding, float("-inf")).amax(dim=-1)
    if tp_group.size() > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
    # Zeros rather than -inf on padding columns keep 0 * inf (NaN) out of values and gradients.
    shifted = (z - z_max.unsqueeze(-1)).masked_fill(padding, 0.0)
    exp = shifted.exp().masked_fill(padding, 0.0)
    return _Softmax(shifted, exp, reduce_from_tensor_model_parallel_region(exp.sum(dim=-1), tp_group), start)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup, *,
                   vocab_size: int) -> torch.Tensor:
    """log p(labels) under ``softmax(logits)``; logits ``[..., V_local]``, labels ``[...]`` -> ``[...]``.

    ``vocab_size`` is the real (HF) vocabulary size; labels must be below it.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    sm = _softmax(logits, tp_group, vocab_size)
    local = labels - sm.vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    picked = sm.shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    label_shifted = reduce_from_tensor_model_parallel_region(torch.where(here, picked, 0.0), tp_group)
    return label_shifted - sm.sum_exp.log()


def token_entropy(logits: torch.Tensor, tp_group: dist.ProcessGroup, *, vocab_size: int) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the real vocabulary; ``[..., V_local]`` -> ``[...]``."""
    sm = _softmax(logits, tp_group, vocab_size)
    # H = log S - sum(e * shifted) / S, with both sums reduced before they meet: a reduced value
    # that fed back into per-rank terms would get only this rank's share of its gradient.
    weighted = reduce_from_tensor_model_parallel_region((sm.exp * sm.shifted).sum(dim=-1), tp_group)
    return sm.sum_exp.log() - weighted / sm.sum_exp
