"""Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE in Megatron-core: HF ``config.json`` -> ``TransformerConfig`` + ``GPTModel``.

The translation from HF config keys (parsed by :mod:`rollpacker.hf_spec`) to
Megatron settings lives only here (:func:`transformer_config`). The
architecture: GQA attention (Qwen2: bias on Q/K/V only; Qwen3: no bias, and
per-head RMSNorm of queries and keys before RoPE, Megatron's ``qk_layernorm``),
RMSNorm, RoPE (non-interleaved halves, as HF's ``rotate_half``), SwiGLU MLP
without biases, tied or untied input/output embeddings.

Qwen3-MoE's sparse layers are Megatron's ``MoELayer``: a softmax top-k router
(HF renormalises the chosen weights when ``norm_topk_prob``: that is Megatron's
top-k over logits then softmax over the chosen; otherwise softmax over all
experts then top-k, Megatron's ``moe_router_pre_softmax``), dropless, its
experts a ``SequentialMLP`` of SwiGLU MLPs split over expert parallelism by
whole experts; its dense layers (``mlp_only_layers``, ``decoder_sparse_step``)
are ``moe_layer_freq``'s zeros. Tokens reach the experts through the alltoall
dispatcher on a GPU and the allgather one on CPU: alltoall creates CUDA streams
at construction (``moe/token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher.__init__``),
and allgather needs every EP rank's micro-batch of one shape
(``Backend.lockstep``).

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
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_ext import cpu_compat
from megatron_ext.sdpa_attention import SDPADotProductAttention
from rollpacker.hf_spec import ModelSpec, parse_spec

VOCAB_MULTIPLE = 128


def padded_vocab_size(spec: ModelSpec, tp: int) -> int:
    """Megatron's vocab rows: the HF vocab padded to a multiple of ``VOCAB_MULTIPLE * tp``."""
    multiple = VOCAB_MULTIPLE * tp
    return math.ceil(spec.vocab_size / multiple) * multiple


def transformer_config(spec: ModelSpec, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                       params_dtype: torch.dtype = torch.float32, recompute: bool = False,
                       aux_loss_coef: float | None = None, routing_replay: bool = False) -> TransformerConfig:
    """The Megatron config of the model ``spec`` describes, for the given parallel sizes and parameter dtype.

    ``recompute``: full activation recompute, one layer per checkpoint: each layer keeps only its
    input and recomputes the rest in backward. ``aux_loss_coef``: the MoE router's load-balancing
    loss coefficient (None: the checkpoint's ``router_aux_loss_coef``); ``routing_replay``: the
    routers can take their experts from outside (:mod:`megatron_ext.routing`).
    """
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype must be torch.float32 or torch.bfloat16, got {params_dtype}")
    spec.check_tp(tp)
    spec.check_ep(ep)
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
        **(_moe_kwargs(spec, tp, ep, aux_loss_coef, routing_replay) if spec.is_moe else {}),
        **cpu_compat.config_kwargs(),
    )


def _moe_kwargs(spec: ModelSpec, tp: int, ep: int, aux_loss_coef: float | None,
                routing_replay: bool) -> dict[str, Any]:
    """The MoE settings of Qwen3-MoE (module docstring)."""
    return dict(
        num_moe_experts=spec.num_experts, moe_router_topk=spec.experts_per_token,
        moe_ffn_hidden_size=spec.moe_intermediate_size, moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_dtype="fp32",  # HF takes the router's softmax in fp32
        moe_layer_freq=[int(i in spec.moe_layers) for i in range(spec.num_layers)],
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=spec.router_aux_loss_coef if aux_loss_coef is None else aux_loss_coef,
        # alltoall exchanges any token counts between EP ranks but creates CUDA streams
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        # megatron-core trains MoE layers with TP only under sequence parallelism (moe/moe_layer.py:379)
        sequence_parallel=tp > 1,
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep, moe_enable_routing_replay=routing_replay)


def _use_transformer_engine() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _layer_spec(config: TransformerConfig, pp_rank: int) -> ModuleSpec | TransformerBlockSubmodules:
    """Transformer Engine's layers where they run; elsewhere Megatron's local layers with fused SDPA.
    A MoE model's block lists its layers (dense and sparse) for this pipeline stage."""
    te = _use_transformer_engine()
    if config.num_moe_experts:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                           pp_rank=pp_rank)
        layers = block.layer_specs
    else:
        block = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm) if te else
                 get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm))
        layers = [block]
    if not te:
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
        if config.sequence_parallel:
            for layer in layers:
                sub = layer.submodules
                sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelRMSNorm
                sub.self_attention.submodules.q_layernorm = SequenceParallelRMSNorm
                sub.self_attention.submodules.k_layernorm = SequenceParallelRMSNorm
            block.layer_norm = SequenceParallelRMSNorm
    return block


class SequenceParallelRMSNorm:
    """torch's RMSNorm for the local layers under sequence parallelism. megatron-core's
    ``WrappedTorchNorm`` refuses it (transformer/torch_norm.py:32) because torch's norm does not
    mark its weight: each TP rank's gradient covers only its own positions (its heads, for q/k
    norms) and must be summed over TP, which ``finalize_model_grads`` (and the CPU backend) do for
    weights marked ``sequence_parallel``."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = True
        return norm


def _moe_without_te() -> None:
    """megatron-core 0.16.1's router reads ``te_general_gemm``, which moe_utils defines only when
    Transformer Engine imports (moe_utils.py:22-39 against :1192): without TE the router raises
    NameError. None is the value its own check (``if te_general_gemm is not None``) expects."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class QwenModel(GPTModel):
    """A ``GPTModel`` that keeps the HF architecture it was built from, for weight conversion."""

    def __init__(self, hf_spec: ModelSpec, **gpt_kwargs: Any) -> None:
        super().__init__(**gpt_kwargs)
        self.hf_spec = hf_spec


def build_model(hf_config: Mapping[str, Any] | str | Path, *, params_dtype: torch.dtype = torch.float32,
                pre_process: bool = True, post_process: bool = True,
                pg_collection: ProcessGroupCollection | None = None, recompute: bool = False,
                aux_loss_coef: float | None = None, routing_replay: bool = False) -> QwenModel:
    """A randomly initialised model for this rank's TP shard and PP stage.

    ``hf_config``: a config of a family :func:`rollpacker.hf_spec.parse_spec` accepts.

    Needs an initialised layout (:func:`megatron_ext.parallel.setup_layout`);
    pass ``pre_process``/``post_process`` for the first/last PP stage and
    ``pg_collection`` (``layout.pg_collection``) to build over explicit groups
    (by default Megatron's initialised ones). Load weights with
    :func:`megatron_ext.weights.load_hf_checkpoint`.
    """
    cpu_compat.apply()
    _moe_without_te()
    spec = parse_spec(hf_config)
    pgs = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    tp, pp, cp = pgs.tp.size(), pgs.pp.size(), pgs.cp.size()
    ep = pgs.ep.size() if spec.is_moe and getattr(pgs, "ep", None) is not None else 1
    config = transformer_config(spec, tp=tp, pp=pp, cp=cp, ep=ep, params_dtype=params_dtype, recompute=recompute,
                                aux_loss_coef=aux_loss_coef, routing_replay=routing_replay)
    model = QwenModel(
        spec, config=config, transformer_layer_spec=_layer_spec(config, pgs.pp.rank()),
        vocab_size=padded_vocab_size(spec, tp),
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
