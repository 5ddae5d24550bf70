"""Analytic performance model of an LLM serving engine on H800 GPUs.

Assumptions (all overridable through ``Efficiency``):

- H800 SXM: 80 GB HBM3 at 3.35 TB/s, ~990 TFLOP/s dense bf16 (H100 compute),
  NVLink 400 GB/s bidirectional, i.e. 200 GB/s each way (the H800's cut).
- bf16 weights and KV cache. Qwen2.5 shapes from the published HF configs:
  7B (7.62e9 params, 28 layers, 4 KV heads), 14B (14.77e9, 48 layers, 8 KV
  heads), 32B (32.76e9, 64 layers, 8 KV heads), head dim 128. KV bytes per
  token = 2 (K and V) x layers x KV heads x head dim x 2 bytes.
- One decode step of a running batch of B requests with C context tokens in
  total takes ``overhead + allreduce + max(weight read, GEMM compute(B)) + C x
  KV read per token``: the GEMMs are bound by reading the weights (1/TP of
  them per GPU) unless the batch is large, attention by reading every
  request's KV cache. 75% of peak bandwidth and 50% of peak FLOPs are
  achieved; 1.5 ms of per-step host and launch overhead; when TP > 1, two
  ring all-reduces per layer of the batch's activations (B x hidden x 2
  bytes), each 12 us of latency + 2(TP-1)/TP x bytes / NVLink bandwidth.
- Prefill of T tokens costs 2 x params x T FLOPs at the same efficiency and
  is charged to the next decode step (chunked into the running batch).
- KV capacity: 85% of the TP group's HBM (SGLang's mem_fraction_static),
  minus the weights, divided by KV bytes per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rollpacker.scheduler.config import TPProfile


@dataclass(frozen=True)
class GPUSpec:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    nvlink_bytes_per_s: float  # one direction


H800 = GPUSpec("H800", 80e9, 3.35e12, 990e12, 200e9)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int = 128

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


QWEN25 = {
    "7b": ModelSpec("Qwen2.5-7B", 7.62e9, 28, 3584, 4),
    "14b": ModelSpec("Qwen2.5-14B", 14.77e9, 48, 5120, 8),
    "32b": ModelSpec("Qwen2.5-32B", 32.76e9, 64, 5120, 8),
}


@dataclass(frozen=True)
class Efficiency:
    bandwidth: float = 0.75  # achieved share of HBM bandwidth
    mfu: float = 0.5  # achieved share of peak FLOPs
    step_overhead_s: float = 1.5e-3  # per decode step: scheduling, launches
    allreduce_s: float = 12e-6  # per all-reduce (two per layer) when TP > 1
    mem_fraction: float = 0.85  # HBM share for weights + KV cache


class DecodeCost:
    """What the modeled engine asks of a cost model. A decode step of ``batch`` requests holding
    ``context`` KV tokens in all takes ``step_base_seconds(batch) + kv_read_s_per_token x context``;
    subclasses say what those are, how long a prefill takes and how many KV tokens fit."""

    kv_read_s_per_token: float
    kv_capacity_tokens: int

    def step_base_seconds(self, batch: int) -> float:
        raise NotImplementedError

    def prefill_seconds(self, tokens: int) -> float:
        raise NotImplementedError

    def decode_seconds(self, steps: int, batch: int, context: int) -> float:
        """``steps`` decode steps of ``batch`` requests starting at ``context`` KV tokens
        (each step reads the KV, then every request appends one token)."""
        return (steps * self.step_base_seconds(batch)
                + self.kv_read_s_per_token * (steps * context + batch * steps * (steps - 1) / 2))

    def steps_within(self, budget: float, batch: int, context: int) -> int:
        """The most decode steps that fit in ``budget`` seconds."""
        if budget <= 0:
            return 0
        a = self.kv_read_s_per_token * batch / 2
        b = self.step_base_seconds(batch) + self.kv_read_s_per_token * (context - batch / 2)
        k = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)) if a > 0 else int(budget / b)
        while k > 0 and self.decode_seconds(k, batch, context) > budget:
            k -= 1
        while self.decode_seconds(k + 1, batch, context) <= budget:
            k += 1
        return k


class PerfModel(DecodeCost):
    """Step times and KV capacity of one engine (a TP group of ``tp`` GPUs)."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec = H800, tp: int = 1, eff: Efficiency = Efficiency()) -> None:
        self.model, self.gpu, self.tp, self.eff = model, gpu, tp, eff
        bw = gpu.hbm_bytes_per_s * eff.bandwidth * tp
        self._weight_read_s = model.weight_bytes / bw
        self._flop_s = gpu.bf16_flops * eff.mfu * tp
        self._allreduces = 2 * model.layers if tp > 1 else 0
        self._allreduce_s_per_request = (2 * (tp - 1) / tp * model.hidden * 2 / gpu.nvlink_bytes_per_s)
        self.kv_read_s_per_token = model.kv_bytes_per_token / bw
        free = gpu.hbm_bytes * tp * eff.mem_fraction - model.weight_bytes
        if free <= 0:
            raise ValueError(f"{model.name} does not fit on {tp} x {gpu.name} (weights {model.weight_bytes:.3g} B)")
        self.kv_capacity_tokens = int(free // model.kv_bytes_per_token)

    def prefill_seconds(self, tokens: int) -> float:
        return 2.0 * self.model.params * tokens / self._flop_s

    def step_base_seconds(self, batch: int) -> float:
        """Decode step time without the KV-read term."""
        allreduce = self._allreduces * (self.eff.allreduce_s + batch * self._allreduce_s_per_request)
        return (self.eff.step_overhead_s + allreduce
                + max(self._weight_read_s, 2.0 * self.model.params * batch / self._flop_s))

    def profile(self, batch: int, context_per_request: int) -> TPProfile:
        """The planner's view: saturated decode throughput at this batch and length."""
        step = self.decode_seconds(1, batch, batch * context_per_request)
        return TPProfile(tp=self.tp, decode_tokens_per_s=batch / step, kv_capacity_tokens=self.kv_capacity_tokens)


class FittedCost(DecodeCost):
    """A cost measured on a machine: a decode step of B requests of x context tokens each takes
    ``step_s + B x (per_request_s + per_context_token_s x x)``, a prefill ``prefill_per_token_s``
    per token (``bench.system.cpu_decode_bound`` fits them for the reference engine on a CPU)."""

    def __init__(self, step_s: float, per_request_s: float, per_context_token_s: float, prefill_per_token_s: float,
                 kv_capacity_tokens: int) -> None:
        self.step_s, self.per_request_s, self.prefill_per_token_s = step_s, per_request_s, prefill_per_token_s
        self.kv_read_s_per_token, self.kv_capacity_tokens = per_context_token_s, kv_capacity_tokens

    def step_base_seconds(self, batch: int) -> float:
        return self.step_s + batch * self.per_request_s

    def prefill_seconds(self, tokens: int) -> float:
        return self.prefill_per_token_s * tokens
