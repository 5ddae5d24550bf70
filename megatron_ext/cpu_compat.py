"""Run megatron-core's model code on machines without CUDA.

megatron-core 0.16 allocates on ``torch.cuda.current_device()``, moves some
tensors with ``.cuda()``, keeps its RNG streams in CUDA generators and builds
the default causal mask with ``device="cuda"``. Without CUDA those calls fail, so :func:`apply` redirects
them to the CPU (measured with megatron-core 0.16.1 and torch 2.13 on CPU). Everything else in megatron-core is
used unchanged. The patches are applied only when CUDA is unavailable, and at
most once per process.

Still CUDA-only after this: ``get_forward_backward_func()`` schedules and the
Megatron optimizers (they allocate ``device="cuda"`` buffers directly).
"""
from __future__ import annotations

from typing import Any

import torch

_applied = False

# Fusions that only exist as CUDA kernels; TransformerConfig must not ask for them on CPU.
CPU_CONFIG_KWARGS: dict[str, Any] = dict(
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    bias_dropout_fusion=False,
    bias_activation_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
)


def needed() -> bool:
    return not torch.cuda.is_available()


def config_kwargs() -> dict[str, Any]:
    """TransformerConfig keyword arguments this machine needs (empty with CUDA)."""
    return dict(CPU_CONFIG_KWARGS) if needed() else {}


def apply() -> bool:
    """Install the CPU redirections if CUDA is unavailable. Idempotent.

    Returns True when the layer is active in this process.
    """
    global _applied
    if _applied or not needed():
        return _applied
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    # e.g. the last PP stage's copy of tied embeddings is moved with .cuda() before its all-reduce.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state())
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state))
    # Used when attention_mask is None with the causal mask type (the usual training call).
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(
        torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    _applied = True
    return True
