"""Qwen2 / Qwen2.5 / Qwen3 dense in Megatron-core: HF ``config.json`` -> ``TransformerConfig`` + ``GPTModel``.

The translation from HF config keys (parsed by :mod:`rollpacker.hf_spec`) to
Megatron settings lives only here (:func:`transformer_config`). The
architecture: GQA attention (Qwen2: bias on Q/K/V only; Qwen3: no bias, and
per-head RMSNorm of queries and keys before RoPE, Megatron's ``qk_layernorm``),
RMSNorm, RoPE (non-interleaved halves, as HF's ``rotate_half``), SwiGLU MLP
without biases, tied or untied input/output embeddings.

The vocabulary is padded to a multiple of ``VOCAB_MULTIPLE * tp`` (as
Megatron-LM does) so that every TP rank holds an equal slice; the padding rows
are not part of the HF model and are masked out by :mod:`megatron_ext.logprobs`.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext import cpu_compat
from megatron_ext.sdpa_attention import SDPADotProductAttention
from rollpacker.hf_spec import ModelSpec, parse_spec

VOCAB_MULTIPLE = 128


def padded_vocab_size(spec: ModelSpec, tp: int) -> int:
    """Megatron's vocab rows: the HF vocab padded to a multiple of ``VOCAB_MULTIPLE * tp``."""
    multiple = VOCAB_MULTIPLE * tp
    return math.ceil(spec.vocab_size / multiple) * multiple


def transformer_config(spec: ModelSpec, *, tp: int = 1, pp: int = 1, cp: int = 1,
                       params_dtype: torch.dtype = torch.float32, recompute: bool = False) -> TransformerConfig:
    """The Megatron config of the model ``spec`` describes, for the given parallel sizes and parameter dtype.

    ``recompute``: full activation recompute, one layer per checkpoint: each layer keeps only its
    input and recomputes the rest in backward.
    """
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype must be torch.float32 or torch.bfloat16, got {params_dtype}")
    spec.check_tp(tp)
    if spec.num_layers % pp:
        raise ValueError(f"config.json: num_hidden_layers={spec.num_layers} is not divisible by "
                         f"pipeline-parallel size {pp}")
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0,
        # HF computes the attention softmax in fp32 whatever the parameter dtype.
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        init_method_std=spec.initializer_range,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        # no CUDA graphs are captured; megatron-core's default "full" is its own deprecated spelling of []
        cuda_graph_scope=[],
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
        **cpu_compat.config_kwargs(),
    )


def _use_transformer_engine() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _layer_spec(qk_norm: bool) -> ModuleSpec:
    """Transformer Engine's layer where it runs; elsewhere Megatron's local layer with fused SDPA."""
    if _use_transformer_engine():
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec


class QwenModel(GPTModel):
    """A ``GPTModel`` that keeps the HF architecture it was built from, for weight conversion."""

    def __init__(self, hf_spec: ModelSpec, **gpt_kwargs: Any) -> None:
        super().__init__(**gpt_kwargs)
        self.hf_spec = hf_spec


def build_model(hf_config: Mapping[str, Any] | str | Path, *, params_dtype: torch.dtype = torch.float32,
                pre_process: bool = True, post_process: bool = True,
                pg_collection: ProcessGroupCollection | None = None, recompute: bool = False) -> QwenModel:
    """A randomly initialised model for this rank's TP shard and PP stage.

    ``hf_config``: a config of a family :func:`rollpacker.hf_spec.parse_spec` accepts.

    Needs an initialised layout (:func:`megatron_ext.parallel.setup_layout`);
    pass ``pre_process``/``post_process`` for the first/last PP stage and
    ``pg_collection`` (``layout.pg_collection``) to build over explicit groups
    (by default Megatron's initialised ones). Load weights with
    :func:`megatron_ext.weights.load_hf_checkpoint`.
    """
    cpu_compat.apply()
    spec = parse_spec(hf_config)
    pgs = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    tp, pp, cp = pgs.tp.size(), pgs.pp.size(), pgs.cp.size()
    config = transformer_config(spec, tp=tp, pp=pp, cp=cp, params_dtype=params_dtype, recompute=recompute)
    model = QwenModel(
        spec, config=config, transformer_layer_spec=_layer_spec(spec.qk_norm), vocab_size=padded_vocab_size(spec, tp),
        max_sequence_length=spec.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=spec.rope_theta,
        pg_collection=pgs)
    # The local spec's torch norms are created in fp32 whatever params_dtype says (TE's follow it, and
    # HF's bf16 checkpoints hold bf16 norms). Mixed dtypes give Megatron's DDP a second, fp32 buffer
    # whose optimizer shards are views into it; on H100 that broke offload and optimizer-state
    # loading of the distributed optimizer. One dtype for every parameter, as on the TE path.
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype != params_dtype:
                p.data = p.data.to(params_dtype)
    return model
