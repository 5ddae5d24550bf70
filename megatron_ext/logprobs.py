"""Per-token log-probabilities and entropy from vocab-parallel logits.

The model's output layer is column-parallel over the padded vocabulary: TP rank
r holds logits for token ids ``[r*V_local, (r+1)*V_local)``. The softmax is
taken over the real vocabulary only (ids >= ``vocab_size`` are padding and get
no probability), with max / sum reductions over ``tp_group``. Results are
identical on every TP rank and differentiable; the loss built from them must be
the same on every TP rank, as in Megatron's own cross entropy, so each rank's
gradient is its own slice of the vocabulary and backward needs no reduction.
Everything is computed in fp32.

Memory. The logits are ``[tokens, V/tp]`` (152k columns for Qwen2.5), so every
fp32 copy of them costs as much as many layers of activations. Both functions
therefore work on chunks of ``CHUNK_TOKENS`` tokens, and the log-prob is an
autograd function that keeps only the logits it was given (already held by the
output layer's graph) plus two numbers per token, recomputing the softmax in
backward: at most one chunk's fp32 working set is alive at a time, where the
plain autograd formulation kept two full fp32 copies for backward and the
entropy four more transiently (six, measured on an H100).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

# Tokens per chunk: the fp32 working set is a few [CHUNK_TOKENS, V/tp] tensors (2048 x 152k x 4 B
# = 1.2 GB each at tp 1), small next to a step's activations, large enough to keep kernels busy.
CHUNK_TOKENS = 2048


def _check(logits: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int) -> tuple[int, torch.Tensor | None]:
    """This rank's first vocabulary id, and its padding columns (ids >= ``vocab_size``), or None
    where it has none: each masking pass is a read and a write of a whole fp32 chunk, skipped
    for vocabularies that need no padding (Qwen2.5's 151,936 is a multiple of 128)."""
    local_vocab = logits.shape[-1]
    if not 0 < vocab_size <= local_vocab * tp_group.size():
        raise ValueError(f"vocab_size={vocab_size} does not fit logits of {local_vocab} columns "
                         f"x {tp_group.size()} TP ranks")
    start = tp_group.rank() * local_vocab
    if start + local_vocab <= vocab_size:
        return start, None
    return start, torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size


def _masked(x: torch.Tensor, padding: torch.Tensor | None, value: float) -> torch.Tensor:
    """``x`` with its padding columns set to ``value`` in place (``x`` itself where there are none)."""
    return x if padding is None else x.masked_fill_(padding, value)


def _global_max(z: torch.Tensor, padding: torch.Tensor | None, tp_group: dist.ProcessGroup) -> torch.Tensor:
    # The max is only a shift for stability: no gradient flows through it.
    z = z.detach()
    z_max = (z if padding is None else z.masked_fill(padding, float("-inf"))).amax(dim=-1)
    if tp_group.size() > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
    return z_max


def _sum(x: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    if tp_group.size() > 1:
        dist.all_reduce(x, group=tp_group)
    return x


class _LabelLogProb(torch.autograd.Function):
    """log p(label) per token; backward recomputes the softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup,
                vocab_size: int) -> torch.Tensor:
        start, padding = _check(logits, tp_group, vocab_size)
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        logp, shift = (torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device) for _ in range(2))
        for a in range(0, flat.shape[0], CHUNK_TOKENS):
            # one fp32 chunk, shifted and exponentiated in place (a copy even for fp32 logits)
            z = flat[a:a + CHUNK_TOKENS].to(torch.float32, copy=True)
            z_max = _global_max(z, padding, tp_group)
            z.sub_(z_max[:, None])
            local = flat_labels[a:a + CHUNK_TOKENS] - start
            here = (local >= 0) & (local < flat.shape[1])
            picked = z.gather(1, local.clamp(0, flat.shape[1] - 1)[:, None])[:, 0]
            label_shifted = _sum(torch.where(here, picked, 0.0), tp_group)
            sum_exp = _sum(_masked(z.exp_(), padding, 0.0).sum(dim=-1), tp_group)
            # log p = (z_label - max) - log sum exp(z - max); keep max + log sum exp for backward
            logp[a:a + CHUNK_TOKENS] = label_shifted - sum_exp.log()
            shift[a:a + CHUNK_TOKENS] = z_max + sum_exp.log()
        ctx.save_for_backward(logits, labels, shift)
        ctx.tp_group, ctx.start, ctx.vocab_size = tp_group, start, vocab_size
        return logp.view(labels.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, shift = ctx.saved_tensors
        _, padding = _check(logits, ctx.tp_group, ctx.vocab_size)
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        g = grad.reshape(-1).float()
        out = torch.empty_like(flat)
        for a in range(0, flat.shape[0], CHUNK_TOKENS):
            # d log p(label) / d z = onehot(label) - softmax(z), this rank's columns only; one fp32
            # chunk, updated in place (a copy even for fp32 logits, which backward must not change)
            grad_z = flat[a:a + CHUNK_TOKENS].to(torch.float32, copy=True)
            _masked(grad_z.sub_(shift[a:a + CHUNK_TOKENS, None]).exp_(), padding, 0.0).neg_()
            local = flat_labels[a:a + CHUNK_TOKENS] - ctx.start
            here = (local >= 0) & (local < flat.shape[1])
            # += 1 at each label this rank holds, without a host round trip (nonzero() syncs)
            grad_z.scatter_add_(1, local.clamp(0, flat.shape[1] - 1)[:, None], here.to(grad_z.dtype)[:, None])
            out[a:a + CHUNK_TOKENS] = grad_z.mul_(g[a:a + CHUNK_TOKENS, None])
        return out.view_as(logits), None, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup, *,
                   vocab_size: int) -> torch.Tensor:
    """log p(labels) under ``softmax(logits)``; logits ``[..., V_local]``, labels ``[...]`` -> ``[...]``.

    ``vocab_size`` is the real (HF) vocabulary size; labels must be below it.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    return _LabelLogProb.apply(logits, labels, tp_group, vocab_size)


def token_entropy(logits: torch.Tensor, tp_group: dist.ProcessGroup, *, vocab_size: int) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the real vocabulary; ``[..., V_local]`` -> ``[...]``."""
    _, padding = _check(logits, tp_group, vocab_size)
    flat = logits.reshape(-1, logits.shape[-1])
    if not torch.is_grad_enabled():  # the trainer's case (a metric): two fp32 chunks, updated in place
        return torch.cat([_entropy_no_grad(flat[a:a + CHUNK_TOKENS], padding, tp_group)
                          for a in range(0, flat.shape[0], CHUNK_TOKENS)]).view(logits.shape[:-1])
    chunks = []
    for a in range(0, flat.shape[0], CHUNK_TOKENS):
        z = flat[a:a + CHUNK_TOKENS].float()
        # Zeros rather than -inf on padding columns keep 0 * inf (NaN) out of values and gradients.
        shifted = z - _global_max(z, padding, tp_group)[:, None]
        if padding is not None:
            shifted = shifted.masked_fill(padding, 0.0)
        exp = shifted.exp()
        if padding is not None:
            exp = exp.masked_fill(padding, 0.0)
        sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1), tp_group)
        # H = log S - sum(e * shifted) / S, with both sums reduced before they meet: a reduced value
        # that fed back into per-rank terms would get only this rank's share of its gradient.
        weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1), tp_group)
        chunks.append(sum_exp.log() - weighted / sum_exp)
    return torch.cat(chunks).view(logits.shape[:-1])


def _entropy_no_grad(chunk: torch.Tensor, padding: torch.Tensor | None,
                     tp_group: dist.ProcessGroup) -> torch.Tensor:
    """The same entropy as :func:`token_entropy`'s differentiable path, without a graph to keep."""
    shifted = chunk.to(torch.float32, copy=True)
    _masked(shifted.sub_(_global_max(shifted, padding, tp_group)[:, None]), padding, 0.0)
    exp = _masked(shifted.exp(), padding, 0.0)
    sum_exp = _sum(exp.sum(dim=-1), tp_group)
    weighted = _sum(exp.mul_(shifted).sum(dim=-1), tp_group)
    return sum_exp.log() - weighted / sum_exp
