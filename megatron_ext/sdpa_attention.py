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
asserts ``packed_seq_params is None``, so the varlen case is computed here by
:mod:`megatron_ext.packed_attention`: on CUDA in bf16/fp16 one FlashAttention
varlen call per micro-batch (``trainer.packed_attention: auto``), elsewhere one
causal SDPA call per packed sequence. (Context parallelism still needs
Transformer Engine; Megatron's parent class refuses ``context_parallel_size > 1``.)
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor, nn

from megatron_ext.packed_attention import PACKED_ATTENTION_MODES, packed_causal_attention, resolve_path


class SDPADotProductAttention(DotProductAttention):
    """Causal (or explicitly masked) attention; same inputs and output layout as the parent."""

    # How packed (THD) input is computed (a PACKED_ATTENTION_MODES value; set_packed_attention sets it
    # per model) and the path its last packed call took.
    packed_attention = "auto"
    packed_path: Optional[str] = None

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
        if mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"packed SDPA attention is causal only, got {mask_type}")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        # The GPU backend keeps cu_seqlens on the host for this module (GpuBackend._seqlens_device), so
        # reading the spans is no device sync; the varlen kernel gets one device copy per micro-batch.
        dropout = self.attention_dropout.p if self.training else 0.0
        path = resolve_path(self.packed_attention, query, dropout_p=dropout)
        self.packed_path = path
        context = packed_causal_attention(query, key, value, cu, path=path, scale=self.softmax_scale,
                                          dropout_p=dropout)
        return context.reshape(context.size(0), 1, self.hidden_size_per_partition)


def uses_sdpa_attention(model: nn.Module) -> bool:
    """Whether ``model``'s core attention is this module's (the layer spec without Transformer Engine)."""
    return any(isinstance(m, SDPADotProductAttention) for m in model.modules())


def set_packed_attention(model: nn.Module, mode: str) -> int:
    """Compute ``model``'s packed (THD) attention by ``mode`` (``trainer.packed_attention``); returns the
    number of attention modules set (0 where Transformer Engine's attention is used instead)."""
    if mode not in PACKED_ATTENTION_MODES:
        raise ValueError(f"packed attention must be one of {PACKED_ATTENTION_MODES}, got {mode!r}")
    modules = [m for m in model.modules() if isinstance(m, SDPADotProductAttention)]
    for m in modules:
        m.packed_attention = mode
    return len(modules)


def packed_attention_paths(model: nn.Module) -> dict[str, int]:
    """How many attention modules took each path in their last packed call (empty before any)."""
    paths: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, SDPADotProductAttention) and m.packed_path is not None:
            paths[m.packed_path] = paths.get(m.packed_path, 0) + 1
    return paths


@contextlib.contextmanager
def megatron_attention(model: nn.Module) -> Iterator[int]:
    """Compute ``model``'s core attention with Megatron's own ``DotProductAttention`` inside the block.

    The reference this module replaces, for parity checks and ``bench/micro/attention.py``;
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
