"""Memory plan: what one GPU holds in each phase of a step, checked before start.

    rollpacker-plan --config configs/qwen2.5-7b.yaml [section.key=value ...]
                    [--nodes 2 --gpus-per-node 8 --device-gb 80 --shape qwen2.5-7b]

The trainer and the rollout engines share every GPU and take turns
(:mod:`rollpacker.memory_phases`): in **rollout** the trainer's params and optimizer
state wait on the host, its gradient buffer is freed (dropped on offload and
zero-filled on onload, like Megatron's ``offload_to_cpu``) and one engine set
holds its weights and KV pool; in **sync** the trainer is back while the
awake engine set's weights are resumed and the new weights pushed into it;
in **train** the engines are released and the trainer adds activations and
log-prob buffers. Every byte of this plan is per GPU, for the worst
pipeline stage and the largest engine set that is built.

Units: bytes; printed in GB = 1e9 bytes. An "80 GB" H100/H800 shows PyTorch
85.0e9 bytes (79.2 GiB), so the CLI's default ``--device-gb 80`` keeps about
5 GB for what the plan does not list (allocator fragmentation, NCCL and
cuBLAS workspaces). The preflight plans against the device's real size.

Not modelled: the host side (pinned copies of params, optimizer state), the
KL reference (kept on host), context-parallel ring buffers (a few KV chunks),
and SGLang's own use outside its static budget (prefill activations, CUDA
graphs): that is what the rollout column's "left" is for. The KV pool is
the static budget an engine set sizes on an otherwise empty GPU; an engine
started while the trainer is resident sizes a smaller one.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from rollpacker.cli_help import HelpFormatter
from rollpacker.config import Config, load_config
from rollpacker.configlib import ConfigError
from rollpacker.hf_spec import ModelSpec, parse_spec

GB = 10**9
DEFAULT_DEVICE_GB = 80.0
BF16, FP32 = 2, 4
# One process's CUDA context with cuBLAS loaded: 0.72 GB on an H100 (torch 2.11, CUDA 13), read
# as mem_get_info's used minus memory_reserved after one bf16 matmul. Every GPU hosts the
# trainer process and, with SGLang, one scheduler process per engine set built.
CUDA_CONTEXT_BYTES = 720 * 10**6
# megatron_ext/logprobs.py works on chunks of LOGPROB_CHUNK_TOKENS tokens (the same constant there;
# tests/unit/test_plan.py checks they agree). Its peak beside the bf16 logits: LOGIT_FP32_COPIES fp32
# [chunk, V/tp] tensors in the forward (log-probs, then the entropy); in the backward, the logits'
# gradient [tokens, V/tp] (their dtype) plus as many chunks (tests/unit/test_plan.py measures both).
LOGPROB_CHUNK_TOKENS = 2048
LOGIT_FP32_COPIES = 2
VOCAB_MULTIPLE = 128  # megatron_ext.model.padded_vocab_size: rows padded to 128 * tp
SHAPES_DIR = Path(__file__).with_name("plan_shapes")
# Nodes of 8 GPUs in the published RollPacker runs (16 / 32 / 64 H800; 8 in the planner experiment):
# the CLI's default world.
PUBLISHED_NODES = {"qwen2.5-7b": 2, "qwen2.5-14b": 4, "qwen2.5-32b": 8, "qwen3-8b": 1}
PHASES = ("rollout", "sync", "train")
GPU, HOST, FREED, ABSENT = "gpu", "host", "freed", "-"


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f}"


# ---- model shapes -------------------------------------------------------------------------------

def padded_vocab(spec: ModelSpec, tp: int) -> int:
    multiple = VOCAB_MULTIPLE * tp
    return math.ceil(spec.vocab_size / multiple) * multiple


def hf_param_count(spec: ModelSpec) -> int:
    """Parameters of the HF checkpoint (the model card's figure)."""
    return sum(math.prod(shape) for shape in spec.hf_shapes().values())


def _layer_weights(spec: ModelSpec, tp: int, kv_heads: int) -> int:
    """One decoder layer on one TP rank holding ``kv_heads`` KV heads; RMSNorm weights are replicated."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d // tp, kv_heads * d
    bias = q + 2 * kv if spec.qkv_bias else 0
    qk_norm = 2 * d if spec.qk_norm else 0
    return h * (q + 2 * kv) + bias + q * h + 3 * h * spec.intermediate_size // tp + 2 * h + qk_norm


def stage_params(spec: ModelSpec, tp: int, pp: int, stage: int) -> int:
    """Parameters on one GPU of the Megatron trainer's pipeline stage ``stage``."""
    h, rows = spec.hidden_size, padded_vocab(spec, tp) // tp
    n = spec.num_layers // pp * _layer_weights(spec, tp, spec.num_kv_heads // tp)
    if stage == 0:
        n += rows * h
    if stage == pp - 1:
        n += h  # final norm
        if not spec.tie_word_embeddings or pp > 1:  # tied: the last stage keeps its own copy
            n += rows * h
    return n


# ---- trainer ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainerState:
    """Bytes of the Megatron DDP buffers and the distributed optimizer's shard on one GPU."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def trainer_state(spec: ModelSpec, *, tp: int, pp: int, stage: int, dp_cp: int, dtype: str) -> TrainerState:
    """megatron-core 0.16.1 with ``grad_reduce_in_fp32=True`` and ``use_distributed_optimizer=True``
    (backend_gpu.py): params in their dtype, an fp32 gradient buffer for every local param, and the
    optimizer's shard over the DP x CP group (DDP reduces over ``dp_cp``): fp32 main params (bf16
    only; fp32 params are their own main copy) and Adam's two fp32 moments."""
    n = stage_params(spec, tp, pp, stage)
    shard = math.ceil(n / dp_cp)
    if dtype == "bf16":
        return TrainerState(params=BF16 * n, grads=FP32 * n, optimizer=3 * FP32 * shard)
    return TrainerState(params=FP32 * n, grads=FP32 * n, optimizer=2 * FP32 * shard)


def layer_activation_bytes(spec: ModelSpec, tp: int, tokens: int, *, te: bool = True) -> int:
    """bf16 activations one decoder layer keeps for backward, on one TP rank, for ``tokens`` tokens.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models" (arXiv:2205.05198), Sec. 4.1 counts per layer
    ``sbh(34 + 5as/h)`` bytes, ``sbh(10 + 24/t + 5as/(ht))`` with tensor
    parallelism and ``sbh(34/t + 5as/(ht))`` with sequence parallelism too.
    Their terms: attention 11sbh + 5as^2b (QKV input 2, Q and K 4, V 2,
    projection input 2, dropout mask 1; softmax output and its dropout mask
    5as^2b), MLP 19sbh (input 2, fc1 output 8, GeLU output 8, mask 1), the two
    LayerNorm inputs 4sbh. For Qwen2 on megatron-core 0.16.1 as configured here:

    - flash / fused attention keeps Q, K, V, its output and an fp32
      log-sum-exp per head, never the s x s scores: the 5as/h term drops;
    - dropout is 0 (no masks);
    - GQA: K and V are ``g*d`` wide, Q and the output ``a*d``;
    - RoPE makes new Q and K, while V stays a view of the fused QKV output,
      which attention's saved V keeps alive whole: 2(a+2g)d + 2(a+g)d;
    - SwiGLU through Megatron's unfused ``glu`` (``bias_activation_fusion``
      is off): the fc1 output ``[T, 2f/t]`` (alive through its chunks), then
      ``silu(gate)``, ``up + glu_linear_offset`` and their product (fc2's
      input), ``f/t`` each: 10f bytes where their GeLU MLP has 16h;
    - sequence parallelism is off, so the norm inputs and outputs (the QKV
      and fc1 inputs) are full ``h`` on every TP rank: 8h with Transformer
      Engine's fused norm + linear. Megatron's local layer (``te=False``) runs
      torch's RMSNorm, which keeps two fp32 copies of its input: 20h.

    - Qwen3's q/k norms read Q and K as views of the fused QKV output
      (already counted) and keep an fp32 1/rms per head, 4(a+g); torch's
      RMSNorm (``te=False``) keeps two fp32 copies of its input, 8(a+g)d more.
      This term is derived, not measured.

    bytes per token = 8h + (2(a+2g)d + 2(a+g)d + 2ad + 4a + 10f [+ qk norms]) / t.

    Measured on an H100 (torch 2.11, megatron-core 0.16.1, local layer,
    Qwen2.5-7B widths, 4 layers): one layer's saved tensors come to this
    formula with ``te=False`` plus RoPE's cos/sin tables (0.4%); a step's
    ``max_memory_allocated`` at 2048 and 4096 tokens came to 1.002x
    :func:`trainer_peak_bytes` (0.98-0.99x with recompute).
    """
    h, d, a, g, f = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    sharded = 2 * (a + 2 * g) * d + 2 * (a + g) * d + 2 * a * d + 4 * a + 10 * f
    if spec.qk_norm:
        sharded += 4 * (a + g) + (0 if te else 8 * (a + g) * d)
    return tokens * (8 if te else 20) * h + math.ceil(tokens * sharded / tp)


def activation_bytes(spec: ModelSpec, *, tp: int, pp: int, stage: int, tokens: int, recompute: bool,
                     te: bool = True) -> int:
    """Activations stage ``stage`` keeps at its peak, ``tokens`` per micro-batch on this GPU.

    1F1B: stage s runs pp - s forwards before its first backward, so the first stage holds as many
    layer-micro-batches as the whole model has layers (Korthikanti Sec. 4.2.3). Full recompute
    (Megatron's ``recompute_granularity="full"``, one layer per checkpoint) keeps each layer's
    input, ``2sbh`` bytes, and rebuilds one layer's working set at a time in backward; counting
    that layer on top of the log-prob buffers overstates the last stage by at most one layer, as
    backward rebuilds it after the logits are freed.
    """
    in_flight, layers = pp - stage, spec.num_layers // pp
    h = spec.hidden_size
    one_layer = layer_activation_bytes(spec, tp, tokens, te=te)
    if recompute:
        kept = in_flight * layers * BF16 * h * tokens + one_layer
    else:
        kept = in_flight * layers * one_layer
    if stage == pp - 1:  # the final norm's input and output (the output layer's input), as in a layer
        kept += (4 if te else 10) * h * tokens
    return kept


def logits_bytes(spec: ModelSpec, tp: int, tokens: int) -> int:
    """bf16 logits ``[tokens, V/tp]`` and the larger of the log-prob code's forward and backward peaks."""
    cols, chunk = padded_vocab(spec, tp) // tp, min(tokens, LOGPROB_CHUNK_TOKENS)
    forward = LOGIT_FP32_COPIES * chunk * FP32
    backward = tokens * BF16 + LOGIT_FP32_COPIES * chunk * FP32
    return cols * (tokens * BF16 + max(forward, backward))


@dataclass(frozen=True)
class StagePeak:
    """What one GPU of pipeline stage ``stage`` holds at its training peak."""

    stage: int
    state: TrainerState
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.state.total + self.activations + self.logits


def stage_peak(spec: ModelSpec, *, tp: int, pp: int, stage: int, dp_cp: int, dtype: str, tokens: int,
               recompute: bool, te: bool = True) -> StagePeak:
    return StagePeak(stage, trainer_state(spec, tp=tp, pp=pp, stage=stage, dp_cp=dp_cp, dtype=dtype),
                     activation_bytes(spec, tp=tp, pp=pp, stage=stage, tokens=tokens, recompute=recompute, te=te),
                     logits_bytes(spec, tp, tokens) if stage == pp - 1 else 0)


def trainer_peak_bytes(spec: ModelSpec, tp: int, micro_batch_tokens: int, recompute: bool = False,
                       dtype: str = "bf16", *, pp: int = 1, cp: int = 1, dp: int = 1, te: bool = True) -> int:
    """Predicted ``torch.cuda.max_memory_allocated()`` of one trainer rank (the worst PP stage).

    ``micro_batch_tokens``: tokens of the largest micro-batch, before the CP split; ``te``: whether
    Megatron runs Transformer Engine's layer (else its local one). Compare from the second
    optimizer step on (Adam's moments exist only after the first); the CUDA context is not part of it.
    """
    tokens = math.ceil(micro_batch_tokens / cp)
    return max(stage_peak(spec, tp=tp, pp=pp, stage=k, dp_cp=dp * cp, dtype=dtype, tokens=tokens,
                          recompute=recompute, te=te).total for k in range(pp))


# ---- rollout engines ----------------------------------------------------------------------------

def engine_weight_bytes(spec: ModelSpec, tp: int, dtype_bytes: int = BF16) -> int:
    """One GPU's shard of an engine's weights; SGLang replicates KV heads when TP exceeds them."""
    h, rows = spec.hidden_size, math.ceil(spec.vocab_size / tp)
    n = spec.num_layers * _layer_weights(spec, tp, max(1, spec.num_kv_heads // tp)) + h + rows * h
    if not spec.tie_word_embeddings:
        n += rows * h
    return n * dtype_bytes


def kv_bytes_per_token(spec: ModelSpec, tp: int, dtype_bytes: int = BF16) -> int:
    """One GPU's KV cache for one token: K and V of every layer, for its share of the KV heads."""
    return 2 * spec.num_layers * max(1, spec.num_kv_heads // tp) * spec.head_dim * dtype_bytes


@dataclass(frozen=True)
class EnginePlan:
    tp: int
    weights: int  # per GPU
    kv_per_token: int  # per GPU; every GPU of an engine holds its share of each token
    static: int  # what the awake set takes per GPU in rollout: weights + KV pool
    min_kv_tokens: int  # one longest request (prompt + response)
    sync_total: int  # the GPU in the sync phase with this set awake
    problem: str = ""  # why it does not fit
    fix: str = ""  # what else than building only larger TPs would

    @property
    def kv_pool(self) -> int:
        return max(0, self.static - self.weights)

    @property
    def kv_tokens(self) -> int:
        return self.kv_pool // self.kv_per_token


# ---- the plan -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    name: str
    nbytes: int
    where: tuple[str, str, str]  # per phase of PHASES: GPU, HOST, FREED or ABSENT
    counted: bool = True  # False: an alternative shown for comparison, not in the totals


@dataclass(frozen=True)
class MemoryPlan:
    header: tuple[str, ...]
    device_bytes: int
    items: tuple[Item, ...]
    engines: tuple[EnginePlan, ...]
    problems: tuple[str, ...]

    def total(self, phase: str) -> int:
        return _total(self.items, phase)

    def left(self, phase: str) -> int:
        return self.device_bytes - self.total(phase)

    @property
    def fits(self) -> bool:
        return not self.problems

    def render(self) -> str:
        w = max(len(item.name) for item in self.items) + 2
        row = lambda name, cells: f"{name:<{w}}" + "".join(f"{c:>9}" for c in cells)  # noqa: E731
        lines = [*self.header, "", row(f"per GPU, GB (device {gb(self.device_bytes)})", PHASES)]
        for item in self.items:
            cells = [gb(item.nbytes) if where == GPU else where for where in item.where]
            lines.append(row(item.name, cells if item.counted else [f"({c})" if c != ABSENT else c for c in cells]))
        lines.append(row("total", [gb(self.total(p)) for p in PHASES]))
        lines.append(row("left", [gb(self.left(p)) for p in PHASES]))
        lines += ["", "rollout engines (one set awake at a time; every rank builds one engine of each TP):",
                  f"{'TP':>4}{'weights':>10}{'KV/token':>11}{'KV pool':>10}{'KV tokens/engine':>18}"
                  f"{'sync total':>12}  fits"]
        for e in self.engines:
            lines.append(f"{e.tp:>4}{gb(e.weights):>10}{e.kv_per_token / 1e3:>8.1f} kB{gb(e.kv_pool):>10}"
                         f"{e.kv_tokens:>18,}{gb(e.sync_total):>12}  {'no' if e.problem else 'yes'}")
        lines.append("")
        lines += [f"DOES NOT FIT: {p}" for p in self.problems] or ["fits"]
        return "\n".join(lines)


def plan_memory(cfg: Config, spec: ModelSpec, *, world_size: int, device_bytes: int, te: bool = True,
                shape_source: str = "") -> MemoryPlan:
    """The memory plan of ``cfg`` on ``world_size`` GPUs of ``device_bytes`` each; ``te``: the trainer
    runs Transformer Engine's layer (else Megatron's local one, see :func:`layer_activation_bytes`)."""
    t, ro, planner = cfg.trainer, cfg.rollout, cfg.scheduler.planner
    src = cfg.source or "config"
    model_parallel = t.tp * t.pp * t.cp
    if world_size % model_parallel:
        raise ConfigError(f"{src}: trainer.tp*pp*cp = {model_parallel} does not divide the world size {world_size}")
    dp = world_size // model_parallel
    longest = cfg.longest_sequence
    # the packer gives a sequence longer than the budget a micro-batch of its own (packing.pack)
    tokens = math.ceil(max(t.micro_batch_tokens, longest) / t.cp)

    def worst_stage(recompute: bool, tokens: int = tokens) -> StagePeak:
        return max((stage_peak(spec, tp=t.tp, pp=t.pp, stage=k, dp_cp=dp * t.cp, dtype=t.params_dtype,
                               tokens=tokens, recompute=recompute, te=te) for k in range(t.pp)),
                   key=lambda s: s.total)

    train = worst_stage(t.recompute)
    sync_state = max(trainer_state(spec, tp=t.tp, pp=t.pp, stage=k, dp_cp=dp * t.cp, dtype=t.params_dtype).total
                     for k in range(t.pp))

    tps = planner.tp_choices(world_size, ro.tp)
    if ro.backend == "sglang":  # bf16 engines in processes of their own; static budget of the whole GPU
        dtype_bytes, contexts = BF16, (1 + len(tps)) * CUDA_CONTEXT_BYTES
        static_name = f"rollout.mem_fraction_static x device = {gb(ro.mem_fraction_static * device_bytes)} GB"
    else:  # the reference engine: fp32, in the trainer's process, a fixed KV budget per engine
        dtype_bytes, contexts = FP32, CUDA_CONTEXT_BYTES
        static_name = "the reference engine's weights + rollout.kv_cache_tokens"
    largest_tensor = spec.vocab_size * spec.hidden_size * (BF16 if t.params_dtype == "bf16" else FP32)
    # weight push (rollout/sglang_backend.py): one bucket queued, the next filling, and the TP all-gather
    # of the tensor being added; a tensor larger than a bucket travels alone
    push = 3 * max(ro.weight_bucket_mb << 20, largest_tensor)

    engines = []
    for tp in tps:
        weights, per_token = engine_weight_bytes(spec, tp, dtype_bytes), kv_bytes_per_token(spec, tp, dtype_bytes)
        static = (int(ro.mem_fraction_static * device_bytes) if ro.backend == "sglang"
                  else weights + ro.kv_cache_tokens * per_token)
        sync_total = contexts + sync_state + weights + push
        problem = fix = ""
        if weights + longest * per_token > static:
            problem = (f"rollout engine TP {tp}: weights {gb(weights)} GB + KV of one longest request "
                       f"({longest} tokens, {gb(longest * per_token)} GB) exceed {static_name}")
            fix = "a higher rollout.mem_fraction_static" if ro.backend == "sglang" else "fewer kv_cache_tokens"
        elif sync_total > device_bytes:
            problem = (f"rollout engine TP {tp} in the sync phase: trainer state {gb(sync_state)} GB + engine "
                       f"weights {gb(weights)} GB + weight push {gb(push)} GB + CUDA contexts {gb(contexts)} GB "
                       f"= {gb(sync_total)} GB > {gb(device_bytes)} GB")
            fix = "less resident trainer state (a higher trainer.tp)"
        engines.append(EnginePlan(tp, weights, per_token, static, longest, sync_total, problem, fix))

    shown = engines[0]  # the smallest TP: the largest weights of any set
    dtype = t.params_dtype
    acts_name = "activations, {} tokens/GPU, recompute {}"
    items = (
        Item(f"trainer params ({dtype})", train.state.params, (HOST, GPU, GPU)),
        Item("trainer grads (fp32 buffer)", train.state.grads, (FREED, GPU, GPU)),
        Item(f"optimizer shard ({'fp32 main + ' if dtype == 'bf16' else ''}Adam m, v; 1/{dp * t.cp})",
             train.state.optimizer, (HOST, GPU, GPU)),
        Item(acts_name.format(tokens, "on" if t.recompute else "off"), train.activations, (ABSENT, ABSENT, GPU)),
        Item(acts_name.format(tokens, "off" if t.recompute else "on"), worst_stage(not t.recompute).activations,
             (ABSENT, ABSENT, GPU), counted=False),
        Item(f"log-prob buffers (bf16 logits + grad, fp32 chunks; V/{t.tp})", train.logits,
             (ABSENT, ABSENT, GPU)),
        Item(f"engine weights (TP {shown.tp})", shown.weights, (GPU, GPU, ABSENT)),
        Item(f"engine KV pool (TP {shown.tp})", shown.kv_pool, (GPU, ABSENT, ABSENT)),
        Item("weight push buffers", push, (ABSENT, GPU, ABSENT)),
        Item(f"CUDA contexts ({contexts // CUDA_CONTEXT_BYTES} processes)", contexts, (GPU, GPU, GPU)),
    )
    problems = [f"{e.problem}; fix: {_engine_fix(e, engines, planner.enabled)}" for e in engines if e.problem]
    train_total = _total(items, "train")
    if train_total > device_bytes:
        problems.append(f"train phase needs {gb(train_total)} GB > {gb(device_bytes)} GB: activations "
                        f"{gb(train.activations)} GB + log-prob buffers {gb(train.logits)} GB + trainer state "
                        f"{gb(train.state.total)} GB; fix: "
                        + _train_fixes(cfg, worst_stage, longest, budget=device_bytes - (train_total - train.total)))
    if _total(items, "rollout") > device_bytes:
        problems.append(f"rollout phase needs {gb(_total(items, 'rollout'))} GB; lower rollout.mem_fraction_static")
    header = (
        f"memory plan: {src}",
        f"model: {spec.num_layers} layers, hidden {spec.hidden_size}, ffn {spec.intermediate_size}, heads "
        f"{spec.num_heads}/{spec.num_kv_heads} kv, vocab {spec.vocab_size}: {hf_param_count(spec) / 1e9:.2f}e9 "
        f"params{f' ({shape_source})' if shape_source else ''}",
        f"world: {world_size} GPUs of {gb(device_bytes)} GB (GB = 1e9 bytes)",
        f"trainer: tp {t.tp}, pp {t.pp}, cp {t.cp}, dp {dp}, {dtype} params; {tokens} tokens per micro-batch "
        f"per GPU = max(trainer.micro_batch_tokens {t.micro_batch_tokens}, longest sequence {longest}) / cp "
        f"{t.cp}; recompute {'on' if t.recompute else 'off'}; worst pipeline stage {train.stage} of {t.pp}",
        f"rollout: {ro.backend}, engine sets for TP {', '.join(map(str, tps))}; static per GPU: {static_name}",
    )
    return MemoryPlan(header, device_bytes, items, tuple(engines), tuple(problems))


def _total(items: Sequence[Item], phase: str) -> int:
    i = PHASES.index(phase)
    return sum(item.nbytes for item in items if item.counted and item.where[i] == GPU)


def _engine_fix(engine: EnginePlan, engines: list[EnginePlan], planner_enabled: bool) -> str:
    fitting = [e.tp for e in engines if not e.problem and e.tp > engine.tp]
    if not planner_enabled:
        return f"a larger rollout.tp, or {engine.fix}"
    if fitting:
        return (f"scheduler.planner.min_tp={fitting[0]} (builds only TPs >= {fitting[0]}; rollout.tp, short_tp "
                f"and long_tp must be >= it too), or {engine.fix}")
    return f"no engine TP fits; {engine.fix}, or a shorter rollout.max_response_length"


def _train_fixes(cfg: Config, worst_stage: Callable[..., StagePeak], longest: int, *, budget: int) -> str:
    """What would make the trainer fit in ``budget`` bytes, each checked against the same model."""
    t = cfg.trainer
    fixes = []
    if not t.recompute:
        recomputed = worst_stage(True)
        fixes.append(f"trainer.recompute=true (activations {gb(recomputed.activations)} GB"
                     + (")" if recomputed.total <= budget else ", not enough alone)"))
    if t.micro_batch_tokens > longest:
        fits = lambda n: worst_stage(t.recompute, math.ceil(n / t.cp)).total <= budget  # noqa: E731
        if fits(longest):
            lo, hi = longest, t.micro_batch_tokens  # fits(lo), not fits(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            fixes.append(f"trainer.micro_batch_tokens <= {lo}")
        else:
            fixes.append(f"trainer.micro_batch_tokens alone does not suffice: the longest sequence "
                         f"({longest} tokens) always gets a micro-batch of its own")
    fixes.append("a higher trainer.tp or trainer.cp (both divide activations and log-prob buffers)")
    return "; or ".join(fixes)


# ---- entry points -------------------------------------------------------------------------------

def resolve_spec(cfg: Config, shape: str | None = None) -> tuple[ModelSpec, str]:
    """The model shape: ``--shape`` (a known name, a config.json or an HF directory), else
    ``model.path/config.json``, else the shipped shape named like ``model.path``'s last part."""
    if shape:
        known = SHAPES_DIR / f"{shape.lower()}.json"
        path = known if known.is_file() else Path(shape)
        return parse_spec(path), str(path)
    own = Path(cfg.model.path) / "config.json"
    if own.is_file():
        return parse_spec(own), str(own)
    known = SHAPES_DIR / f"{Path(cfg.model.path).name.lower()}.json"
    if known.is_file():
        return parse_spec(known), f"{known.relative_to(SHAPES_DIR.parent.parent)}, as {own} does not exist"
    names = ", ".join(sorted(p.stem for p in SHAPES_DIR.glob("*.json")))
    raise ConfigError(f"{cfg.source}: model.path: no {own}; pass --shape (one of {names}, or a config.json)")


def check_memory(cfg: Config, world_size: int) -> None:
    """Preflight: on a GPU run (CUDA visible, or the SGLang backend), refuse a plan that does not fit."""
    import torch
    cuda = torch.cuda.is_available()
    if not cuda and cfg.rollout.backend != "sglang":
        return
    if cuda:  # device properties do not create a CUDA context
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        device_bytes = torch.cuda.get_device_properties(index).total_memory
    else:
        device_bytes = int(DEFAULT_DEVICE_GB * GB)
    spec, _ = resolve_spec(cfg)
    te = importlib.util.find_spec("transformer_engine") is not None  # as megatron_ext.model picks the layer
    plan = plan_memory(cfg, spec, world_size=world_size, device_bytes=device_bytes, te=te)
    if plan.problems:
        raise ConfigError(f"{cfg.source}: the memory plan does not fit {gb(device_bytes)} GB per GPU: "
                          + " | ".join(plan.problems)
                          + f" (python -m rollpacker.plan --config {cfg.source} prints the plan)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollpacker-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/qwen2.5-7b.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.recompute=true")
    p.add_argument("--nodes", type=int,
                   help="default: the published run's (2/4/8 for Qwen2.5-7B/14B/32B, 1 for Qwen3-8B), else 1")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--device-gb", type=float, default=DEFAULT_DEVICE_GB, help="GPU memory in GB of 1e9 bytes")
    p.add_argument("--no-te", dest="te", action="store_false",
                   help="the trainer runs without Transformer Engine (Megatron's local layer)")
    p.add_argument("--shape", help="model shape: a name in rollpacker/plan_shapes, a config.json or an HF "
                                   "directory (default: model.path/config.json, else the shipped shape)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        spec, source = resolve_spec(cfg, args.shape)
        name = (args.shape or Path(cfg.model.path).name).lower()
        nodes = args.nodes or PUBLISHED_NODES.get(name, 1)
        plan = plan_memory(cfg, spec, world_size=nodes * args.gpus_per_node,
                           device_bytes=int(args.device_gb * GB), te=args.te, shape_source=source)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"rollpacker.plan: {exc}", file=sys.stderr)
        return 2
    print(plan.render())
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
