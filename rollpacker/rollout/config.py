"""Configuration of the rollout engines."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollpacker.configlib import ConfigError, require_power_of_two

# SGLang engine ports (``sglang_args.engine_ports``): each engine led by a node-local rank gets a
# block of SGLANG_PORT_BLOCK ports (sglang binds ``port`` and ``nccl_port = port + 1``), one block per
# layout per local rank: TP size 1, 2, 4, ... 2**(SGLANG_MAX_TP_BITS - 1), each with every EP size
# dividing it (SGLANG_LAYOUT_SLOTS in all), so a node's engines use
# [sglang_base_port, sglang_base_port + SGLANG_PORT_SPAN).
SGLANG_PORT_BLOCK = 16
SGLANG_MAX_TP_BITS = 5
SGLANG_LAYOUT_SLOTS = SGLANG_MAX_TP_BITS * (SGLANG_MAX_TP_BITS + 1) // 2
SGLANG_MAX_LOCAL_RANKS = 16
SGLANG_PORT_SPAN = SGLANG_PORT_BLOCK * SGLANG_LAYOUT_SLOTS * SGLANG_MAX_LOCAL_RANKS
# launch/train.sh puts the torchrun rendezvous (MASTER_PORT) in [20000, 29000): engines stay out of it.
RENDEZVOUS_PORTS = range(20000, 29000)


@dataclass
class ReplayConfig:
    """Length replay (``rollpacker.rollout.replay``): each response as long as a length trace says."""

    enabled: bool = False
    trace: str | None = None  # a JSONL length trace (docs/formats.md); None: the parametric model below
    median: float = 64.0  # parametric: the median response length, in tokens
    sigma_prompt: float = 0.8  # parametric: spread of a prompt's median (log-normal)
    sigma_response: float = 0.65  # parametric: spread of a response around its prompt's median
    seed: int = 0

    def validate(self) -> None:
        if self.trace is not None and not Path(self.trace).is_file():
            raise ConfigError(f"length_replay.trace {self.trace!r} is not a file")
        if self.median < 1 or self.sigma_prompt < 0 or self.sigma_response < 0:
            raise ConfigError(f"length_replay needs median >= 1 and sigmas >= 0, got median={self.median}, "
                              f"sigma_prompt={self.sigma_prompt}, sigma_response={self.sigma_response}")


@dataclass
class RolloutConfig:
    backend: Literal["reference", "sglang"] = "reference"
    tp: int = 1  # starting rollout TP size; the planner may change it per round
    # a MoE model's experts in this many blocks over an engine's ranks while the planner is off
    # (scheduler.planner.short_ep / long_ep otherwise); divides tp
    ep: int = 1
    max_response_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    kv_cache_tokens: int = 65536  # reference engine: KV budget per engine, in tokens
    kv_page_size: int = 16  # reference engine: tokens per KV page (the unit of admission/preemption)
    max_prefill_tokens: int = 16384  # reference engine: padded prompt tokens prefilled in one forward
    seed: int = 0  # seeds requests submitted without their own seed
    # The engine's weights, KV and compute: auto is fp32 for the reference engine and an sglang engine
    # on CPU, the checkpoint's dtype for sglang on a GPU. bf16 against an fp32 trainer makes the
    # engine-trainer gap real on a CPU (trainer.mismatch measures and corrects it).
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    max_running_requests: int = 256
    mem_fraction_static: float = 0.7  # sglang
    weight_bucket_mb: int = 512  # size bound of one weight-update bucket
    sglang_base_port: int = 30000  # sglang: a node's engines use [base, base + SGLANG_PORT_SPAN)
    drain_timeout_s: float = 120.0  # sglang: longest wait for aborted requests to drain before a release
    # sglang on a GPU: the engine's attention and sampling kernels (sglang's --attention-backend and
    # --sampling-backend). The defaults run the sglang 0.5.17 bundle carried to a GPU machine without
    # flashinfer's kernels (``sglang_args.GPU_ENGINE_ENV``); None or "auto" leaves the choice to sglang,
    # for a full sglang install. A CPU engine always runs torch_native / pytorch.
    sglang_attention_backend: str | None = "triton"
    sglang_sampling_backend: str | None = "pytorch"
    # sglang's --enable-deterministic-inference: batch-invariant kernels, so a response's log-probs do
    # not depend on what else shares its batch (a part of the engine-trainer gap, not all of it:
    # docs/mismatch.md). sglang accepts it with the triton, fa3, fa4 and flashinfer attention backends.
    sglang_deterministic_inference: bool = False
    # the reference engine computes with the trainer's own Megatron forward at a fixed window
    # (data.max_prompt_length + max_response_length), so its log-probs equal the CPU trainer's bit for
    # bit (rollpacker/rollout/matched.py); no KV cache, so every decode step costs a whole window
    match_trainer: bool = False
    # the engine reports the experts its MoE router chose for every token (trainer.routing_replay replays them)
    return_routing: bool = False
    # each response as long as a trace says, stop tokens ignored: a timing tool (rollpacker.rollout.replay)
    length_replay: ReplayConfig = field(default_factory=ReplayConfig)

    @property
    def seeded(self) -> bool:
        """The engines sample each response from its own seed alone, so its length does not depend
        on the machine's timing: the reference engine (and the trainer-matched one) always, sglang
        only with deterministic inference (its sampler reads ``sampling_seed`` only then)."""
        return self.backend == "reference" or self.sglang_deterministic_inference

    def validate(self) -> None:
        require_power_of_two("tp", self.tp)
        require_power_of_two("ep", self.ep)
        if self.ep > self.tp:
            raise ConfigError(f"ep={self.ep} must divide tp={self.tp}: an engine's experts are split over its ranks")
        if self.max_response_length < 1:
            raise ConfigError(f"max_response_length must be >= 1, got {self.max_response_length}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.kv_cache_tokens < 1:
            raise ConfigError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        for key in ("kv_page_size", "max_prefill_tokens", "max_running_requests", "weight_bucket_mb"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 or >= 1, got {self.top_k}")
        top = self.sglang_base_port + SGLANG_PORT_SPAN
        if self.sglang_base_port < 1024 or top > 65536:
            raise ConfigError(f"sglang_base_port must be in [1024, {65536 - SGLANG_PORT_SPAN}] (a node's engines "
                              f"use {SGLANG_PORT_SPAN} ports from it), got {self.sglang_base_port}")
        if self.sglang_base_port < RENDEZVOUS_PORTS.stop and top > RENDEZVOUS_PORTS.start:
            raise ConfigError(f"sglang ports [{self.sglang_base_port}, {top}) overlap the rendezvous ports "
                              f"[{RENDEZVOUS_PORTS.start}, {RENDEZVOUS_PORTS.stop}) of launch/train.sh")
        for key in ("sglang_attention_backend", "sglang_sampling_backend"):
            if getattr(self, key) == "":
                raise ConfigError(f"{key} must name a backend, or be null or auto for sglang's own choice")
        if self.drain_timeout_s <= 0:
            raise ConfigError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        if self.match_trainer and (self.backend != "reference" or self.dtype == "bf16"):
            raise ConfigError(f"match_trainer computes with the trainer's fp32 Megatron model inside the reference "
                              f"engine; got backend={self.backend!r}, dtype={self.dtype!r}: set "
                              "rollout.backend=reference and rollout.dtype=auto (or fp32), or match_trainer=false")
        self.length_replay.validate()
