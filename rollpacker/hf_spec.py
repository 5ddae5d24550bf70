"""The architecture facts of an HF ``config.json`` of a supported family, validated once.

Supported families (``model_type``): ``qwen2`` (Qwen2/Qwen2.5: bias on Q/K/V) and
``qwen3`` (Qwen3 dense: no QKV bias, RMSNorm over each query and key head before
RoPE, ``head_dim`` independent of ``hidden_size / num_attention_heads``). Both model
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

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

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
                p + "self_attn.v_proj.weight": (kv, h)})
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (self.head_dim,),
                               p + "self_attn.k_norm.weight": (self.head_dim,)})
            shapes.update({
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


@dataclass(frozen=True)
class _Family:
    """What sets a family apart, as read from its config.json."""

    name: str  # for messages
    qkv_bias: bool
    qk_norm: bool
    default_head_dim: int | None  # when config.json has no head_dim (None: hidden_size / num_attention_heads)


# model_type -> family; a model_type not listed here is refused with this list.
FAMILIES = {
    "qwen2": _Family("Qwen2/Qwen2.5", qkv_bias=True, qk_norm=False, default_head_dim=None),
    # transformers' Qwen3Config defaults head_dim to 128 whatever the hidden size
    "qwen3": _Family("Qwen3 dense", qkv_bias=False, qk_norm=True, default_head_dim=128),
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
        qkv_bias=family.qkv_bias, qk_norm=family.qk_norm)
