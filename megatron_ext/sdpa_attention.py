"""Megatron's local core attention computed by ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's ``DotProductAttention`` (the core attention of the local,
non-Transformer-Engine layer spec) materialises the ``[b, heads, s, s]`` scores,
a separate softmax and the probabilities kept for backward. On a CPU that
makes a micro-batch of long rows cost far more than its tokens (8 rows of 480
tokens took 2.8x the time of 4 such rows). PyTorch's fused SDPA computes the
same attention blockwise. This subclass keeps Megatron's module (init, TP
head split, checkpoint layout) and replaces only the arithmetic; it is used
wherever Transformer Engine is not installed.

That includes CUDA machines without Transformer Engine, where the GPU backend
feeds packed (THD) micro-batches: Megatron's own ``DotProductAttention``
asserts ``packed_seq_params is None``, so the varlen case is computed here as
one causal SDPA call per packed sequence. (Context parallelism still needs
Transformer Engine; Megatron's parent class refuses ``context_parallel_size > 1``.)
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor, nn


class SDPADotProductAttention(DotProductAttention):
    """Causal (or explicitly masked) attention; same inputs and output layout as the parent."""

    def __init__(self, config, *args, **kwargs) -> None:
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPA core attention supports softmax_type='vanilla' only, "
                             f"got {config.softmax_type!r}")
        super().__init__(config, *args, **kwargs)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPA core attention takes no attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, mask_type)
        # Megatron's boolean masks mark the positions to hide; SDPA's mark those to keep.
        mask = None if attention_mask is None else ~attention_mask
        return self._sdpa(query, key, value, mask, causal=mask is None and mask_type == AttnMaskType.causal)

    def _sdpa(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], causal: bool) -> Tensor:
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            dropout_p=self.attention_dropout.p if self.training else 0.0, scale=self.softmax_scale,
            enable_gqa=q.size(1) != k.size(1))
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(context.size(2), context.size(0), self.hidden_size_per_partition)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams,
                mask_type: AttnMaskType) -> Tensor:
        """THD: ``[T, heads, d]`` (Megatron squeezes the dummy batch) holding sequences back to back.

        Each sequence occupies its padded span (``cu_seqlens_q_padded`` when set, as Megatron's
        RoPE reads it), real tokens first; causal attention over the span is exact for the real
        tokens, and the padding after them only attends within its own sequence, so its
        (unused) outputs stay finite. Returns ``[T, 1, heads * d]``.
        """
        if params.qkv_format != "thd" or query.dim() != 3:
            raise ValueError(f"packed sequences must be THD [tokens, heads, dim], got format "
                             f"{params.qkv_format!r} and a query of shape {tuple(query.shape)}")
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        if mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"packed SDPA attention is causal only, got {mask_type}")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        # The GPU backend keeps cu_seqlens on the host for this module (GpuBackend._seqlens_device), so
        # reading them here is no device sync.
        lengths = cu.diff().tolist()
        if sum(lengths) != query.size(0):
            raise ValueError(f"cu_seqlens ends at {sum(lengths)} but the packed row holds {query.size(0)} tokens")
        # torch.split, not one slice per sequence: the backward of a slice zero-fills a tensor of the
        # whole row and copies into it (sequences x tokens of traffic); split's backward is one cat.
        pieces = zip(*(torch.split(t, lengths) for t in (query, key, value)))
        return torch.cat([self._sdpa(q, k, v, None, causal=True) for q, k, v in pieces if q.size(0)])


def uses_sdpa_attention(model: nn.Module) -> bool:
    """Whether ``model``'s core attention is this module's (the layer spec without Transformer Engine)."""
    return any(isinstance(m, SDPADotProductAttention) for m in model.modules())


@contextlib.contextmanager
def megatron_attention(model: nn.Module) -> Iterator[int]:
    """Compute ``model``'s core attention with Megatron's own ``DotProductAttention`` inside the block.

    The reference this module replaces, for parity checks and ``bench/bench_attention.py``;
    the subclass adds no state, so switching the class back and forth is exact. Yields the
    number of attention modules switched.
    """
    modules = [m for m in model.modules() if type(m) is SDPADotProductAttention]
    for m in modules:
        m.__class__ = DotProductAttention
    try:
        yield len(modules)
    finally:
        for m in modules:
            m.__class__ = SDPADotProductAttention
