"""Causal attention over a packed (THD) micro-batch: one kernel call for the whole micro-batch.

The GPU backend feeds many sequences back to back (``[T, heads, dim]``, sequence
spans given by ``cu_seqlens``). Each query may attend to the keys of its own span
at or before its position. Three ways to compute that, chosen in one place,
:func:`resolve_path`:

``varlen``
    ``torch.nn.attention.varlen.varlen_attn``, FlashAttention's varlen kernel: one
    call per micro-batch. Read in torch 2.11.0's ``torch/nn/attention/varlen.py``:
    ``varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
    return_aux=None, scale=None, window_size=(-1, -1))``; causal is
    ``window_size=(-1, 0)`` (the function sets ``is_causal = window_size == (-1, 0)``);
    it is a ``torch.library.custom_op`` over ``aten::_flash_attention_forward`` with a
    registered autograd (``_varlen_attn_backward`` -> ``aten::_flash_attention_backward``).
    torch 2.11 has no ``enable_gqa`` there (2.12 added it; 2.13's signature has it),
    so without it the key/value heads are expanded here (:func:`expand_kv_heads`,
    the head mapping of SDPA's ``enable_gqa``). FlashAttention runs on CUDA only
    (torch 2.13 on CPU: "Could not run 'aten::_flash_attention_forward' with
    arguments from the 'CPU' backend"), compute capability 8.0 or newer, in
    fp16/bf16, head dim a multiple of 8 up to 256. The first published signature
    (``is_causal=False``, no ``scale``) is not used. This is the CUDA path ``auto`` picks.
``flex``
    ``torch.nn.attention.flex_attention.flex_attention`` with a document-and-causal
    ``BlockMask`` (``create_block_mask`` over the span id of each token), also one
    call; same API in torch 2.11.0 and 2.13. Fast only compiled, so on CUDA it runs
    ``torch.compile(flex_attention)`` (triton and a C compiler on the node). On CPU
    torch runs it eagerly, forward only (``_validate_device``: "FlexAttention does
    not support backward on CPU"). Chosen only when asked for.
``per_sequence``
    one causal ``scaled_dot_product_attention`` call per sequence: the reference,
    and what runs where neither kernel does (CPU, fp32 on CUDA, attention dropout).

The padded span of each sequence (``cu_seqlens_q_padded`` when set) is what every
path attends within: real tokens first, then padding that sees only its own
sequence, so the three agree on every position, padding included.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rollpacker.trainer.config import PACKED_ATTENTION_MODES  # trainer.packed_attention's values

log = logging.getLogger(__name__)

PATHS = ("varlen", "flex", "per_sequence")

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


# -- which path ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _VarlenApi:
    fn: Callable[..., Tensor]
    native_gqa: bool  # the signature has enable_gqa (torch >= 2.12)


_varlen_api_cache: list[Any] = [None, None]  # [function seen, its _VarlenApi or None]


def varlen_api() -> _VarlenApi | None:
    """torch's ``varlen_attn`` if it has the signature used here (``scale`` and ``window_size``), else None.

    Looked up on every call (cached per function object), so a stand-in installed over
    ``torch.nn.attention.varlen.varlen_attn`` is seen, signature included.
    """
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    fn = getattr(varlen, "varlen_attn", None)
    if fn is None:
        return None
    if _varlen_api_cache[0] is not fn:
        params = inspect.signature(fn).parameters
        api = _VarlenApi(fn, "enable_gqa" in params) if {"scale", "window_size"} <= params.keys() else None
        _varlen_api_cache[:] = [fn, api]
    return _varlen_api_cache[1]


def varlen_unavailable(device_type: str, dtype: torch.dtype, head_dim: int,
                       capability: tuple[int, int] | None = None) -> str | None:
    """Why the varlen kernel cannot run on such tensors (on a GPU of this compute ``capability``),
    or None when it can."""
    if device_type != "cuda":
        return f"FlashAttention's varlen kernel is CUDA-only (tensors on {device_type})"
    if capability is not None and capability < (8, 0):
        return f"torch's FlashAttention needs compute capability 8.0 or newer, this GPU has {capability}"
    if dtype not in _FLASH_DTYPES:
        return f"FlashAttention takes fp16/bf16, not {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention takes head dims that are multiples of 8 up to 256, not {head_dim}"
    if varlen_api() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn(..., scale, window_size)"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_logged: set[str] = set()


def resolve_path(requested: str, query: Tensor, *, dropout_p: float = 0.0) -> str:
    """The path that computes this call: the one place where ``auto`` is decided.

    ``auto``: ``varlen`` where it runs (CUDA, fp16/bf16, a torch that has it), else
    ``per_sequence``. An explicit ``varlen`` or ``flex`` is taken as asked (torch's own
    error says why it cannot run); neither kernel has attention dropout.
    """
    if requested not in PACKED_ATTENTION_MODES:
        raise ValueError(f"packed attention must be one of {PACKED_ATTENTION_MODES}, got {requested!r}")
    if requested == "per_sequence":
        return requested
    if dropout_p > 0:
        if requested == "auto":
            return "per_sequence"
        raise ValueError(f"packed attention {requested!r} has no attention dropout (p={dropout_p}); "
                         f"use 'per_sequence' or 'auto'")
    if requested != "auto":
        return requested
    capability = _capability(query.device.index) if query.is_cuda else None
    reason = varlen_unavailable(query.device.type, query.dtype, query.size(-1), capability)
    if reason is None:
        return "varlen"
    if reason not in _logged:
        _logged.add(reason)
        log.info("packed attention: per-sequence SDPA (%s)", reason)
    return "per_sequence"


# -- the packing, shared by every path -----------------------------------------------------------------------

@dataclass(eq=False)
class Packing:
    """One micro-batch's sequence spans, read from its host ``cu_seqlens`` (no device sync).

    Device copies (offsets for varlen, the block mask for flex) are made on first use and
    kept with it: every layer of the micro-batch reads the same ``cu_seqlens`` tensor.
    """
    cu_seqlens: Tensor
    lengths: list[int]
    max_len: int
    _on_device: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def offsets(self, device: torch.device) -> Tensor:
        """int32 ``cu_seqlens`` on ``device`` (varlen's ``cu_seq_q``/``cu_seq_k``)."""
        key = ("offsets", device)
        if key not in self._on_device:
            self._on_device[key] = self.cu_seqlens.to(device=device, dtype=torch.int32)
        return self._on_device[key]

    def block_mask(self, device: torch.device) -> Any:
        """FlexAttention's mask: a query sees the keys of its own span at or before it."""
        key = ("block_mask", device)
        if key not in self._on_device:
            from torch.nn.attention.flex_attention import create_block_mask
            doc = torch.repeat_interleave(torch.arange(len(self.lengths), device=device),
                                          torch.tensor(self.lengths, device=device))
            self._on_device[key] = create_block_mask(document_causal_mask_mod(doc), None, None, self.tokens,
                                                     self.tokens, device=device)
        return self._on_device[key]


def document_causal_mask_mod(doc: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """FlexAttention ``mask_mod``: same span (``doc`` holds each token's span index) and not in the future."""
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
    return mask_mod


_last_packing: list[Packing] = []


def packing_of(cu_seqlens: Tensor) -> Packing:
    """The :class:`Packing` of ``cu_seqlens``; the last one is kept (held, so its id cannot be reused)."""
    if _last_packing and _last_packing[0].cu_seqlens is cu_seqlens:
        return _last_packing[0]
    lengths = cu_seqlens.diff().tolist()  # host tensor on the GPU backend: no sync
    packing = Packing(cu_seqlens, lengths, max(lengths, default=0))
    _last_packing[:] = [packing]
    return packing


def expand_kv_heads(key: Tensor, value: Tensor, query_heads: int) -> tuple[Tensor, Tensor]:
    """GQA for kernels without it: query head ``h`` uses key/value head ``h // (query_heads / kv_heads)``
    (SDPA's ``enable_gqa`` and Megatron's query-group layout); the backward sums each group's gradients."""
    kv_heads = key.size(1)
    if query_heads % kv_heads:
        raise ValueError(f"{query_heads} query heads are not a multiple of {kv_heads} key/value heads")
    groups = query_heads // kv_heads
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


# -- the kernels ---------------------------------------------------------------------------------------------

def _per_sequence(q: Tensor, k: Tensor, v: Tensor, packing: Packing, scale: float | None,
                  dropout_p: float) -> Tensor:
    # torch.split, not one slice per sequence: the backward of a slice zero-fills a tensor of the
    # whole row and copies into it (sequences x tokens of traffic); split's backward is one cat.
    outputs = []
    for qs, ks, vs in zip(*(torch.split(t, packing.lengths) for t in (q, k, v))):
        if qs.size(0):
            # [s, heads, d] -> [heads, s, d] and back
            out = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                 is_causal=True, dropout_p=dropout_p, scale=scale,
                                                 enable_gqa=qs.size(1) != ks.size(1))
            outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


def _varlen(q: Tensor, k: Tensor, v: Tensor, packing: Packing, scale: float | None) -> Tensor:
    api = varlen_api()
    if api is None:
        raise RuntimeError(f"packed attention 'varlen' needs torch.nn.attention.varlen.varlen_attn with scale and "
                           f"window_size (torch >= 2.10); this is torch {torch.__version__}")
    gqa = q.size(1) != k.size(1)
    if gqa and not api.native_gqa:
        k, v = expand_kv_heads(k, v, q.size(1))
    offsets = packing.offsets(q.device)
    return api.fn(q.contiguous(), k.contiguous(), v.contiguous(), offsets, offsets, packing.max_len, packing.max_len,
                  scale=scale, window_size=(-1, 0), **({"enable_gqa": True} if gqa and api.native_gqa else {}))


_compiled_flex: list[Callable[..., Tensor]] = []


def _flex_function(device: torch.device) -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention
    if not _compiled_flex:
        _compiled_flex.append(torch.compile(flex_attention))
    return _compiled_flex[0]


def _flex(q: Tensor, k: Tensor, v: Tensor, packing: Packing, scale: float | None) -> Tensor:
    # [T, heads, d] -> [1, heads, T, d] and back
    out = _flex_function(q.device)(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                   block_mask=packing.block_mask(q.device), scale=scale,
                                   enable_gqa=q.size(1) != k.size(1))
    return out[0].transpose(0, 1)


def packed_causal_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, *, path: str,
                            scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    """Causal attention within each span of ``cu_seqlens`` (int32 ``[n + 1]``, best on the host).

    ``query`` ``[T, heads, d]``, ``key``/``value`` ``[T, kv_heads, d]``; returns ``[T, heads, d]``
    computed by ``path`` (see :func:`resolve_path`). ``scale``: None is ``1/sqrt(d)``.
    """
    if path not in PATHS:
        raise ValueError(f"packed attention path must be one of {PATHS}, got {path!r}")
    if query.dim() != 3 or key.shape != value.shape or key.size(0) != query.size(0):
        raise ValueError(f"packed attention takes query [T, heads, d] and key/value [T, kv_heads, d], got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    packing = packing_of(cu_seqlens)
    if packing.tokens != query.size(0):
        raise ValueError(f"cu_seqlens ends at {packing.tokens} but the packed row holds {query.size(0)} tokens")
    if path == "per_sequence":
        return _per_sequence(query, key, value, packing, scale, dropout_p)
    if dropout_p > 0:
        raise ValueError(f"packed attention {path!r} has no attention dropout (p={dropout_p})")
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    return (_varlen if path == "varlen" else _flex)(query, key, value, packing, scale)
