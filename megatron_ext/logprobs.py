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

Passes. Each elementwise op over a chunk reads and writes ``[chunk, V/tp]`` fp32
values; on an H100 these memory-bound passes took about 40% of a Qwen2.5-0.5B
micro-batch's GPU time. So the trainer's entropy (a metric) comes from the
log-prob's own forward pass instead of a second pass over the logits, the max is
taken on the logits as they are (exact in bf16) rather than on an fp32 copy, and
backward folds the label's one and the upstream gradient into two in-place ops.
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


def _global_max(raw: torch.Tensor, padding: torch.Tensor | None, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """Each row's max over the real vocabulary, in fp32. Taken on the logits as they are: the max
    of bf16 values is exact in bf16, so no fp32 copy is read for it. Only a shift for stability:
    no gradient flows through it."""
    raw = raw.detach()
    z_max = (raw if padding is None else raw.masked_fill(padding, float("-inf"))).amax(dim=-1).float()
    if tp_group.size() > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
    return z_max


def _sum(x: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    if tp_group.size() > 1:
        dist.all_reduce(x, group=tp_group)
    return x


def _shifted(raw: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``raw - shift`` per row, as a new fp32 tensor. A copy and then an in-place subtraction: a
    bf16 - fp32 subtraction would, on CPU, first convert ``raw`` into a temporary fp32 tensor of
    its own (a second chunk alive at once)."""
    return raw.to(torch.float32, copy=True).sub_(shift[:, None])


def _label_columns(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's column on this rank (clamped into range) and whether this rank holds it."""
    local = labels - start
    return local.clamp(0, width - 1)[:, None], (local >= 0) & (local < width)


def _chunk_forward(raw: torch.Tensor, labels: torch.Tensor | None, start: int, padding: torch.Tensor | None,
                   tp_group: dist.ProcessGroup, entropy: bool):
    """One chunk's log sum exp shift, label log-prob and entropy, in one pass over its columns.

    Two fp32 ``[chunk, V/tp]`` tensors are alive at most: the shifted logits and their
    exponentials, which become ``e * z`` in place for the entropy. The
    entropy is ``log S - sum(e * z) / S`` with ``e = exp(z)`` and ``S = sum(e)``.
    """
    z_max = _global_max(raw, padding, tp_group)
    z = _shifted(raw, z_max)
    exp = _masked(z.exp(), padding, 0.0)
    sum_exp = _sum(exp.sum(dim=-1), tp_group)
    log_sum = sum_exp.log()
    logp = ent = None
    if labels is not None:
        column, here = _label_columns(labels, start, raw.shape[1])
        label_z = _sum(torch.where(here, z.gather(1, column)[:, 0], 0.0), tp_group)
        logp = label_z - log_sum
    if entropy:
        ent = log_sum - _sum(exp.mul_(z).sum(dim=-1), tp_group) / sum_exp
    return z_max + log_sum, logp, ent


class _LabelLogProb(torch.autograd.Function):
    """log p(label) per token (and, without gradient, the entropy); backward recomputes the softmax
    chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup,
                vocab_size: int, entropy: bool):
        start, padding = _check(logits, tp_group, vocab_size)
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        rows = flat.shape[0]
        logp, shift = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(2))
        ent = torch.empty(rows if entropy else 0, dtype=torch.float32, device=logits.device)
        for a in range(0, rows, CHUNK_TOKENS):
            b = a + CHUNK_TOKENS
            shift[a:b], logp[a:b], chunk_entropy = _chunk_forward(
                flat[a:b], flat_labels[a:b], start, padding, tp_group, entropy)
            if entropy:
                ent[a:b] = chunk_entropy
        ctx.save_for_backward(logits, labels, shift)
        ctx.tp_group, ctx.start, ctx.vocab_size = tp_group, start, vocab_size
        ent = ent.view(labels.shape if entropy else (0,))
        ctx.mark_non_differentiable(ent)
        return logp.view(labels.shape), ent

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, labels, shift = ctx.saved_tensors
        _, padding = _check(logits, ctx.tp_group, ctx.vocab_size)
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        minus_g = grad.reshape(-1).float().neg()
        out = torch.empty_like(flat)
        for a in range(0, flat.shape[0], CHUNK_TOKENS):
            b = a + CHUNK_TOKENS
            # d log p(label) / d z = onehot(label) - softmax(z), this rank's columns only. One fp32
            # chunk: softmax made from the logits' dtype and exponentiated in place, minus one at
            # each label this rank holds (scatter_add_ needs no host round trip, nonzero() would),
            # then scaled by -g in place (a product written into a bf16 ``out=`` would go through an
            # fp32 temporary chunk of its own).
            grad_z = _masked(_shifted(flat[a:b], shift[a:b]).exp_(), padding, 0.0)
            column, here = _label_columns(flat_labels[a:b], ctx.start, flat.shape[1])
            grad_z.scatter_add_(1, column, here.to(grad_z.dtype).neg_()[:, None])
            out[a:b] = grad_z.mul_(minus_g[a:b, None])
        return out.view_as(logits), None, None, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup, *,
                   vocab_size: int, with_entropy: bool = False):
    """log p(labels) under ``softmax(logits)``; logits ``[..., V_local]``, labels ``[...]`` -> ``[...]``.

    ``vocab_size`` is the real (HF) vocabulary size; labels must be below it. With ``with_entropy``
    also each token's entropy, detached, from the same pass over the logits (``(logp, entropy)``):
    a separate entropy pass reads and writes the fp32 logits as often again.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    logp, entropy = _LabelLogProb.apply(logits, labels, tp_group, vocab_size, with_entropy)
    return (logp, entropy) if with_entropy else logp


def token_entropy(logits: torch.Tensor, tp_group: dist.ProcessGroup, *, vocab_size: int) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the real vocabulary; ``[..., V_local]`` -> ``[...]``,
    differentiable where grad is enabled."""
    start, padding = _check(logits, tp_group, vocab_size)
    flat = logits.reshape(-1, logits.shape[-1])
    if not torch.is_grad_enabled():
        return torch.cat([_chunk_forward(flat[a:a + CHUNK_TOKENS], None, start, padding, tp_group, True)[2]
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
