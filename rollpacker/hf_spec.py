"""The architecture facts of an HF ``config.json`` of a supported family, validated once.

Supported families (``model_type``): ``qwen2`` (Qwen2/Qwen2.5: bias on Q/K/V),
``qwen3`` (Qwen3 dense: no QKV bias, RMSNorm over each query and key head before
RoPE, ``head_dim`` independent of ``hidden_size / num_attention_heads``) and
``qwen3_moe`` (Qwen3-MoE: Qwen3's attention; in its sparse layers a softmax router
picks ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts, their weights
renormalised over the chosen ones when ``norm_topk_prob``; no shared expert). Both model
implementations read their shapes from here: the Megatron-core model
(``megatron_ext.model``) and the rollout engine's plain-PyTorch model
(``rollpacker.rollout.qwen_torch``), so the two can never disagree on what a
checkpoint means.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts of a supported HF config, validated."""

    model_type: str
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
    qkv_bias: bool  # q_proj/k_proj/v_proj carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm of queries and keys before RoPE: q_norm/k_norm of size head_dim (Qwen3)
    # Mixture of experts (Qwen3-MoE); num_experts 0: a dense model
    num_experts: int = 0
    experts_per_token: int = 0  # num_experts_per_tok: the router's top-k
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # the top-k weights renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()  # the sparse layers (decoder_sparse_step, mlp_only_layers); others dense
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's coefficient in pretraining

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def check_tp(self, tp: int) -> None:
        """Refuse a TP size this model cannot be split over, naming the HF key at fault."""
        for key, value in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                           ("intermediate_size", self.intermediate_size),
                           *((("moe_intermediate_size", self.moe_intermediate_size),) if self.is_moe else ())):
            if value % tp:
                raise ValueError(f"config.json: {key}={value} is not divisible by tensor-parallel size {tp}; "
                                 f"choose a TP size that divides it")

    def check_ep(self, ep: int) -> None:
        """Refuse an expert-parallel size this model cannot be split over."""
        if ep > 1 and not self.is_moe:
            raise ValueError(f"expert-parallel size {ep} needs a mixture-of-experts model; this "
                             f"{self.model_type} model has no experts: set it to 1")
        if self.is_moe and self.num_experts % ep:
            raise ValueError(f"config.json: num_experts={self.num_experts} is not divisible by expert-parallel "
                             f"size {ep}; choose an EP size that divides it")

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Layer ``layer``'s MLP tensors by HF name (below ``model.layers.{layer}.``)."""
        h = self.hidden_size
        if layer not in self.moe_layers:
            i = self.intermediate_size
            return {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
        i, shapes = self.moe_intermediate_size, {"mlp.gate.weight": (self.num_experts, h)}
        for e in range(self.num_experts):
            shapes.update({f"mlp.experts.{e}.gate_proj.weight": (i, h), f"mlp.experts.{e}.up_proj.weight": (i, h),
                           f"mlp.experts.{e}.down_proj.weight": (h, i)})
        return shapes

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
                p + "self_attn.v_proj.weight": (kv, h)})
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (self.head_dim,),
                               p + "self_attn.k_norm.weight": (self.head_dim,)})
            shapes.update({p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,)})
            shapes.update({p + name: shape for name, shape in self.mlp_shapes(i).items()})
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


@dataclass(frozen=True)
class _Family:
    """What sets a family apart, as read from its config.json."""

    name: str  # for messages
    qkv_bias: bool
    qk_norm: bool
    default_head_dim: int | None  # when config.json has no head_dim (None: hidden_size / num_attention_heads)
    moe: bool = False


# model_type -> family; a model_type not listed here is refused with this list.
FAMILIES = {
    "qwen2": _Family("Qwen2/Qwen2.5", qkv_bias=True, qk_norm=False, default_head_dim=None),
    # transformers' Qwen3Config defaults head_dim to 128 whatever the hidden size
    "qwen3": _Family("Qwen3 dense", qkv_bias=False, qk_norm=True, default_head_dim=128),
    # transformers' Qwen3MoeAttention falls back to hidden_size / num_attention_heads
    "qwen3_moe": _Family("Qwen3-MoE", qkv_bias=False, qk_norm=True, default_head_dim=None, moe=True),
}


def parse_spec(hf_config: Mapping[str, Any] | str | Path) -> ModelSpec:
    """Validate an HF config of a supported family and extract what the model needs."""
    where = "config.json" if isinstance(hf_config, Mapping) else f"{hf_config}"
    cfg = load_hf_config(hf_config)
    family = FAMILIES.get(cfg.get("model_type"))
    if family is None:
        supported = ", ".join(f"{k!r} ({f.name})" for k, f in FAMILIES.items())
        raise ValueError(f"{where}: model_type={cfg.get('model_type')!r} is not supported; supported: {supported}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "rms_norm_eps") if k not in cfg]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={cfg['hidden_act']!r}, only 'silu' (SwiGLU) is supported")
    if cfg.get("attention_bias", False) and not family.qkv_bias:
        # Qwen3's attention_bias adds a bias to o_proj as well, which no released checkpoint has.
        raise ValueError(f"{where}: attention_bias=true is not supported for {family.name}; set it to false")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=true is not supported; set it to false")
    moe = _moe_fields(cfg, where) if family.moe else {}
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return ModelSpec(
        model_type=cfg["model_type"],
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or family.default_head_dim or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=_rope_theta(cfg, where), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        initializer_range=cfg.get("initializer_range", 0.02),
        qkv_bias=family.qkv_bias, qk_norm=family.qk_norm, **moe)


def _moe_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A Qwen3-MoE config's expert fields, validated; variants no model here implements are refused."""
    # transformers 5 writes num_local_experts; the published checkpoints write num_experts
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                              ("moe_intermediate_size", cfg.get("moe_intermediate_size"))) if v is None]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    top_k = cfg["num_experts_per_tok"]
    if not 1 <= top_k <= experts:
        raise ValueError(f"{where}: num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"{where}: shared_expert_intermediate_size={cfg['shared_expert_intermediate_size']}: shared "
                         "experts (Qwen2-MoE's) are not supported; Qwen3-MoE has none")
    router = cfg.get("scoring_func", "softmax")
    if router != "softmax" or cfg.get("topk_method", "greedy") != "greedy":
        raise ValueError(f"{where}: scoring_func={router!r}, topk_method={cfg.get('topk_method')!r}: only "
                         "Qwen3-MoE's softmax top-k router is supported")
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    if step < 1:
        raise ValueError(f"{where}: decoder_sparse_step={step} must be >= 1")
    layers = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, experts_per_token=top_k, moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=layers,
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))
