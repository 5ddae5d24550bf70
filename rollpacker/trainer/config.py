"""Configuration of the trainer (GRPO on Megatron-core)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from rollpacker.configlib import ConfigError

# How the GPU backend computes packed (THD) attention without Transformer Engine; the paths are
# described in megatron_ext/packed_attention.py, which takes its modes from here.
PackedAttention = Literal["auto", "varlen", "flex", "per_sequence"]
PACKED_ATTENTION_MODES: tuple[str, ...] = get_args(PackedAttention)

Correct = Literal["off", "token", "sequence", "geometric"]


@dataclass
class MismatchConfig:
    """``trainer.mismatch``: what is measured and whether the policy gradient is corrected for it."""

    # off (default, as in veRL and slime) | token | sequence | geometric
    correct: Correct = "off"
    mode: Literal["truncate", "mask"] = "truncate"
    high: float = 2.0  # veRL's rollout_is_threshold and slime's tis_clip / MIS upper bound
    low: float | None = None  # None: 0 to truncate (an upper cap only), 1/high to mask
    # response lengths (tokens) that separate the diagnostics' buckets
    length_buckets: list[int] = field(default_factory=lambda: [512, 2048, 8192])

    @property
    def lower(self) -> float:
        """The lower bound of the correction's weights."""
        if self.low is not None:
            return self.low
        return 0.0 if self.mode == "truncate" else 1.0 / self.high

    @property
    def share_low(self) -> float:
        """The lower threshold the diagnostics count tokens and responses below."""
        return self.low if self.low else 1.0 / self.high

    def validate(self) -> None:
        if self.correct not in ("off", "token", "sequence", "geometric"):
            raise ConfigError(f"correct must be off, token, sequence or geometric, got {self.correct!r}")
        if self.mode not in ("truncate", "mask"):
            raise ConfigError(f"mode must be truncate or mask, got {self.mode!r}")
        if not self.high > 1:
            raise ConfigError(f"high must be > 1 (a weight bound above the on-policy 1), got {self.high}")
        if self.low is not None and not 0 <= self.low < 1:
            raise ConfigError(f"low must be in [0, 1) (or null for the mode's default), got {self.low}")
        edges = self.length_buckets
        if any(e < 1 for e in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
            raise ConfigError(f"length_buckets must be increasing positive token counts, got {edges}")

    def bucket_names(self) -> list[str]:
        bounds = [0, *self.length_buckets]
        return [f"len_{lo}_{hi}" for lo, hi in zip(bounds, self.length_buckets)] + [f"len_{bounds[-1]}_up"]


@dataclass
class TrainerConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # expert parallelism (mixture-of-experts models): each expert lives on one of ep ranks, which
    # exchange tokens in every sparse layer; the experts themselves split over trainer.tp as dense
    # layers do. ep must divide the model's num_experts and world_size / (tp * pp).
    ep: int = 1
    # The MoE router's load-balancing loss coefficient (None: the checkpoint's router_aux_loss_coef).
    # As megatron-core weighs it with per-token losses: each micro-batch's loss, summed over its
    # sparse layers, enters the objective once and is divided by the step's tokens with the policy
    # loss.
    moe_aux_loss_coef: float | None = None
    # MoE: the trainer's routers take the experts the rollout engine chose for each token (which
    # needs rollout.return_routing), so that its log-probs go through the experts that generated the
    # response (megatron_ext/routing.py)
    routing_replay: bool = False
    lr: float = 1e-6
    # Linear warm-up: optimizer step k (from 1) runs at lr * min(1, k / lr_warmup_steps). Adam's
    # first bias-corrected updates move every weight by about lr whatever its gradient, so a fresh
    # optimizer on a tuned policy spends its first steps on noise unless the rate starts low.
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    # dual clip (veRL's actor.clip_ratio_c, default 3 there): for A < 0 the token loss is capped at
    # -A * clip_ratio_c; None (the default here) turns it off
    clip_ratio_c: float | None = None
    kl_coef: float = 0.0
    std_normalize: bool = True
    adv_eps: float = 1e-6  # added to the group's reward std before dividing
    loss_aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    micro_batch_tokens: int = 8192
    params_dtype: Literal["fp32", "bf16"] = "bf16"
    # full activation recompute: keep only each layer's input, rebuild the rest in backward
    # (about a third more trainer compute; rollpacker.plan shows what it saves)
    recompute: bool = False
    stream: bool = True  # stream trainer in long rounds
    stream_trigger_low: float = 0.2  # fraction of requests done before the hand-off may fire
    stream_trigger_high: float = 0.5
    old_logprobs: Literal["recompute", "engine"] = "recompute"
    # the engine-trainer gap: diagnostics every step, importance-sampling correction (off by default)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    # Packed (THD) attention of the GPU backend without Transformer Engine
    # (megatron_ext/packed_attention.py): "auto" is one FlashAttention varlen call per micro-batch
    # where torch has it (CUDA, bf16/fp16) and one SDPA call per sequence elsewhere; "varlen",
    # "flex" (FlexAttention with a document mask, compiled) and "per_sequence" force a path.
    packed_attention: PackedAttention = "auto"
    # GPU backend: Megatron's fused SwiGLU (bias_activation_fusion, torch.compile'd: needs triton
    # and a C compiler on the node) instead of separate silu and multiply kernels.
    fused_swiglu: bool = False

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (counted from 1)."""
        return self.lr * min(1.0, step / self.lr_warmup_steps) if self.lr_warmup_steps else self.lr

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.moe_aux_loss_coef is not None and self.moe_aux_loss_coef < 0:
            raise ConfigError(f"moe_aux_loss_coef must be >= 0 (or null for the checkpoint's), got {self.moe_aux_loss_coef}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"lr_warmup_steps must be >= 0 (0: no warm-up), got {self.lr_warmup_steps}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ConfigError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={self.clip_low}, "
                              f"clip_high={self.clip_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ConfigError(f"clip_ratio_c must be > 1 (the dual clip caps -A * ratio for A < 0 at "
                              f"-A * clip_ratio_c; leave it unset to turn it off), got {self.clip_ratio_c}")
        if self.adv_eps <= 0:
            raise ConfigError(f"adv_eps must be > 0, got {self.adv_eps}")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            raise ConfigError("adam_beta1 and adam_beta2 must be in [0, 1)")
        if not 0 < self.stream_trigger_low <= self.stream_trigger_high < 1:
            raise ConfigError("need 0 < stream_trigger_low <= stream_trigger_high < 1")
        if self.mismatch.correct != "off" and self.old_logprobs == "engine":
            raise ConfigError(
                f"mismatch.correct={self.mismatch.correct} weights each token by pi_train / pi_rollout, "
                "which needs the trainer's own log-probs as the old policy; with old_logprobs=engine the PPO "
                "ratio is already taken against the engine's (pi / pi_rollout). Set old_logprobs=recompute, or "
                "mismatch.correct=off")
        if self.packed_attention not in PACKED_ATTENTION_MODES:
            raise ConfigError(f"packed_attention must be one of {', '.join(PACKED_ATTENTION_MODES)}, "
                              f"got {self.packed_attention!r}")
