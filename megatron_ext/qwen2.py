"""Qwen2 / Qwen2.5 in Megatron-core: HF ``config.json`` -> ``TransformerConfig`` + ``GPTModel``.

The translation from HF config keys to Megatron settings lives only here
(:func:`transformer_config`). The architecture: GQA attention with bias on
Q/K/V only, RMSNorm, RoPE (non-interleaved halves, as HF's ``rotate_half``),
SwiGLU MLP without biases, tied or untied input/output embeddings.

The vocabulary is padded to a multiple of ``VOCAB_MULTIPLE * tp`` (as
Megatron-LM does) so that every TP rank holds an equal slice; the padding rows
are not part of the HF model and are masked out by :mod:`megatron_ext.logprobs`.
"""
from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
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

from megatron_ext import cpu_compat

VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class Qwen2Spec:
    """The architecture facts of a Qwen2-family HF config, validated."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    initializer_range: float

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int) -> int:
        multiple = VOCAB_MULTIPLE * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def check_tp(self, tp: int) -> None:
        """Refuse a TP size this model cannot be split over, naming the HF key at fault."""
        for key, value in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                           ("intermediate_size", self.intermediate_size)):
            if value % tp:
                raise ValueError(f"config.json: {key}={value} is not divisible by tensor-parallel size {tp}; "
                                 f"choose a TP size that divides it")

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the HF checkpoint, in the order :func:`megatron_ext.weights.iter_hf_tensors` yields."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
            })
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def load_hf_config(hf_config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """A config.json as a dict, from a dict, a checkpoint directory or the file itself."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    path = Path(hf_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config at {path}")
    return json.loads(path.read_text())


def _rope_theta(cfg: Mapping[str, Any], where: str) -> float:
    # transformers 5 writes rope_parameters; 4.x checkpoints (the published Qwen2.5) write rope_theta.
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported (only plain RoPE)")
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where}: missing rope_theta (or rope_parameters.rope_theta)")
    return float(theta)


def parse_spec(hf_config: Mapping[str, Any] | str | Path) -> Qwen2Spec:
    """Validate a Qwen2-family HF config and extract what the model needs."""
    where = "config.json" if isinstance(hf_config, Mapping) else f"{hf_config}"
    cfg = load_hf_config(hf_config)
    if cfg.get("model_type") != "qwen2":
        raise ValueError(f"{where}: model_type={cfg.get('model_type')!r}, expected 'qwen2' (Qwen2/Qwen2.5)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "rms_norm_eps") if k not in cfg]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={cfg['hidden_act']!r}, only 'silu' (SwiGLU) is supported")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=true is not supported; set it to false")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return Qwen2Spec(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=_rope_theta(cfg, where), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        initializer_range=cfg.get("initializer_range", 0.02))


def transformer_config(spec: Qwen2Spec, *, tp: int = 1, pp: int = 1, cp: int = 1,
                       params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """The Megatron config of a Qwen2 model, for the given parallel sizes and parameter dtype."""
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
        add_bias_linear=False, add_qkv_bias=True,
        gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0,
        # HF computes the attention softmax in fp32 whatever the parameter dtype.
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        init_method_std=spec.initializer_range,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        **cpu_compat.config_kwargs(),
    )


def _use_transformer_engine() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


class Qwen2Model(GPTModel):
    """A ``GPTModel`` that keeps the HF architecture it was built from, for weight conversion."""

    def __init__(self, hf_spec: Qwen2Spec, **gpt_kwargs: Any) -> None:
        super().__init__(**gpt_kwargs)
        self.hf_spec = hf_spec


def build_model(hf_config: Mapping[str, Any] | str | Path, *, params_dtype: torch.dtype = torch.float32,
                pre_process: bool = True, post_process: bool = True,
                pg_collection: ProcessGroupCollection | None = None) -> Qwen2Model:
    """A randomly initialised Qwen2 model for this rank's TP shard and PP stage.

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
    config = transformer_config(spec, tp=tp, pp=pp, cp=cp, params_dtype=params_dtype)
    layer_spec = (get_gpt_layer_with_transformer_engine_spec() if _use_transformer_engine()
                  else get_gpt_layer_local_spec(normalization="RMSNorm"))
    return Qwen2Model(
        spec, config=config, transformer_layer_spec=layer_spec, vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=spec.rope_theta,
        pg_collection=pgs)
