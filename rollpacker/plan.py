"""Memory plan: what one GPU holds in each phase of a step, checked before start.

    rollpacker-plan --config configs/qwen2.5-7b.yaml [section.key=value ...]
                    [--nodes 2 --gpus-per-node 8 --device-gb 80 --shape qwen2.5-7b]

The trainer and the rollout engines share every GPU and take turns
(:mod:`rollpacker.memory_phases`): in **rollout** the trainer's params and optimizer
state wait on the host, its gradient buffer is freed (dropped on offload and
zero-filled on onload, like Megatron's ``offload_to_cpu``) and one engine set
holds its weights and KV pool; in **sync** the trainer keeps only its params,
which the weight push reads (its optimizer state, fp32 main weights and Adam
moments, waits on the host and its grads are freed), while the awake engine
set's weights are resumed and the new weights pushed into it; in **train** the
engines are released and the whole trainer is back, adding activations and
log-prob buffers. Every byte of this plan is per GPU, for the worst
pipeline stage and the largest engine set that is built.

Units: bytes; printed in GB = 1e9 bytes. An "80 GB" H100/H800 shows PyTorch
85.0e9 bytes (79.2 GiB), so the CLI's default ``--device-gb 80`` keeps about
5 GB for what the plan does not list (allocator fragmentation, NCCL and
cuBLAS workspaces). The preflight plans against the device's real size.

What each tensor weighs for the model and layout, mixture-of-experts models
included (and what is not modelled for them), is :mod:`rollpacker.plan_sizes`.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from rollpacker.cli_help import HelpFormatter
from rollpacker.config import Config, load_config
from rollpacker.configlib import ConfigError
from rollpacker.hf_spec import ModelSpec, parse_spec
from rollpacker.plan_sizes import (BF16, FP32, GB, StagePeak, activated_params, engine_weight_bytes,
                                   expert_param_count, gb, hf_param_count, kv_bytes_per_token,
                                   sequence_parallel, stage_peak, trainer_state)

DEFAULT_DEVICE_GB = 80.0
# One process's CUDA context with cuBLAS loaded: 0.72 GB on an H100 (torch 2.11, CUDA 13), read
# as mem_get_info's used minus memory_reserved after one bf16 matmul. Every GPU hosts the
# trainer process and, with SGLang, one scheduler process per engine set built.
CUDA_CONTEXT_BYTES = 720 * 10**6
SHAPES_DIR = Path(__file__).with_name("plan_shapes")
# Nodes of 8 GPUs in the published RollPacker runs (16 / 32 / 64 H800; 8 in the planner experiment),
# and configs/qwen3-30b-a3b.yaml's 1 node: the CLI's default world.
PUBLISHED_NODES = {"qwen2.5-7b": 2, "qwen2.5-14b": 4, "qwen2.5-32b": 8, "qwen3-8b": 1, "qwen3-30b-a3b": 1}
PHASES = ("rollout", "sync", "train")
GPU, HOST, FREED, ABSENT = "gpu", "host", "freed", "-"


# ---- rollout engines ----------------------------------------------------------------------------

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
        lines += ["", "rollout engines (one set awake at a time; every rank builds one engine of each layout; "
                      "weights per GPU are the TP's at any EP):",
                  f"{'TP':>4}{'weights':>10}{'KV/token':>11}{'KV pool':>10}{'KV tokens/engine':>18}"
                  f"{'sync total':>12}  fits"]
        for e in self.engines:
            lines.append(f"{e.tp:>4}{gb(e.weights):>10}{e.kv_per_token / 1e3:>8.1f} kB{gb(e.kv_pool):>10}"
                         f"{e.kv_tokens:>18,}{gb(e.sync_total):>12}  {'no' if e.problem else 'yes'}")
        lines.append("")
        lines += [f"DOES NOT FIT: {p}" for p in self.problems] or ["fits"]
        return "\n".join(lines)


def plan_memory(cfg: Config, spec: ModelSpec, *, world_size: int, device_bytes: int, te: bool = True,
                shape_source: str = "", fixes: bool = True) -> MemoryPlan:
    """The memory plan of ``cfg`` on ``world_size`` GPUs of ``device_bytes`` each; ``te``: the trainer
    runs Transformer Engine's layer (else Megatron's local one, see
    :func:`rollpacker.plan_sizes.layer_activation_bytes`). ``fixes``: a problem names what would fix it,
    for a mixture-of-experts trainer a layout that fits (:func:`fitting_layouts`); False: only the
    problems (the layout search's trials)."""
    t, ro, planner = cfg.trainer, cfg.rollout, cfg.scheduler.planner
    src = cfg.source or "config"
    model_parallel = t.tp * t.pp * t.cp
    if world_size % model_parallel:
        raise ConfigError(f"{src}: trainer.tp*pp*cp = {model_parallel} does not divide the world size {world_size}")
    check_expert_parallel(cfg, spec, world_size)
    dp = world_size // model_parallel
    longest = cfg.longest_sequence
    # the packer gives a sequence longer than the budget a micro-batch of its own (packing.pack)
    tokens = math.ceil(max(t.micro_batch_tokens, longest) / t.cp)

    def worst_stage(recompute: bool, tokens: int = tokens, ep: int = t.ep) -> StagePeak:
        return max((stage_peak(spec, tp=t.tp, pp=t.pp, stage=k, dp_cp=dp * t.cp, dtype=t.params_dtype,
                               tokens=tokens, recompute=recompute, te=te, ep=ep) for k in range(t.pp)),
                   key=lambda s: s.total)

    train = worst_stage(t.recompute)
    # in sync the trainer keeps its params alone (the weight push reads them); optimizer state on host, grads freed
    sync_state = max(trainer_state(spec, tp=t.tp, pp=t.pp, stage=k, dp_cp=dp * t.cp, dtype=t.params_dtype,
                                   ep=t.ep).params for k in range(t.pp))

    tps = planner.tp_choices(world_size, ro.tp)
    layouts = planner.layout_choices(world_size, ro.tp, ro.ep)
    if ro.backend == "sglang":  # bf16 engines in processes of their own; static budget of the whole GPU
        # a process per engine set, one set per layout (an EP size at a TP adds one; its weights per GPU
        # are those of the TP: the experts split over the same ranks)
        dtype_bytes, contexts = BF16, (1 + len(layouts)) * CUDA_CONTEXT_BYTES
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
            problem = (f"rollout engine TP {tp} in the sync phase: trainer params {gb(sync_state)} GB + engine "
                       f"weights {gb(weights)} GB + weight push {gb(push)} GB + CUDA contexts {gb(contexts)} GB "
                       f"= {gb(sync_total)} GB > {gb(device_bytes)} GB")
            higher = "trainer.tp, trainer.ep or trainer.pp" if spec.is_moe else "trainer.tp"
            fix = f"fewer resident trainer params (a higher {higher})"
        engines.append(EnginePlan(tp, weights, per_token, static, longest, sync_total, problem, fix))

    shown = engines[0]  # the smallest TP: the largest weights of any set
    dtype = t.params_dtype
    acts_name = "activations, {} tokens/GPU, recompute {}"
    items = (
        Item(f"trainer params ({dtype})", train.state.params, (HOST, GPU, GPU)),
        Item("trainer grads (fp32 buffer)", train.state.grads, (FREED, FREED, GPU)),
        Item(f"optimizer shard ({'fp32 main + ' if dtype == 'bf16' else ''}Adam m, v; 1/{dp * t.cp}"
             + (f", experts 1/{dp * t.cp // t.ep})" if spec.is_moe else ")"), train.state.optimizer, (HOST, HOST, GPU)),
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
    failing = [e for e in engines if e.problem]
    problems = [f"{e.problem}; fix: {_engine_fix(e, engines, planner.enabled)}" for e in failing]
    # the problems the trainer's layout can fix: the train phase, an engine beside the trainer's params in sync
    trainer_bound = [i for i, e in enumerate(failing) if e.weights + longest * e.kv_per_token <= e.static]
    train_total = _total(items, "train")
    if train_total > device_bytes:
        trainer_bound.insert(0, len(problems))
        budget = device_bytes - (train_total - train.total)
        problems.append(f"train phase needs {gb(train_total)} GB > {gb(device_bytes)} GB: activations "
                        f"{gb(train.activations)} GB + log-prob buffers {gb(train.logits)} GB + trainer state "
                        f"{gb(train.state.total)} GB"
                        + ("; fix: " + _train_fixes(cfg, spec, worst_stage, longest, world_size=world_size,
                                                    budget=budget) if fixes else ""))
    if spec.is_moe and fixes and trainer_bound:  # a MoE trainer's state is mostly experts: a layout that fits
        # beside the trainer's params in sync at the least: the lightest engine set, alone, and the weight push
        lightest = min(engines, key=lambda e: e.weights)
        beside = (lightest.tp, lightest.weights, push, (2 if ro.backend == "sglang" else 1) * CUDA_CONTEXT_BYTES)
        problems[trainer_bound[0]] += _layout_fix(cfg, spec, world_size=world_size, device_bytes=device_bytes, te=te,
                                                  beside=beside)
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
        f"rollout: {ro.backend}, engine sets for {', '.join(map(str, layouts))}; "
        f"static per GPU: {static_name}",
        # mixture of experts: below the lines a dense model has, which keep their places
        *((f"experts: {len(spec.moe_layers)} sparse layers of {spec.num_experts} experts (ffn "
           f"{spec.moe_intermediate_size}), top {spec.experts_per_token}: {expert_param_count(spec) / 1e9:.2f}e9 "
           f"expert params, {activated_params(spec) / 1e9:.2f}e9 activated per token; trainer ep {t.ep}: "
           f"{spec.num_experts // t.ep} experts per GPU, each split over tp {t.tp}, expert data parallel "
           f"{dp * t.cp // t.ep}, {gb(train.state.experts)} GB of the trainer state"
           + ("; sequence parallel over tp" if sequence_parallel(spec, t.tp) else ""),) if spec.is_moe else ()),
    )
    return MemoryPlan(header, device_bytes, items, tuple(engines), tuple(problems))


def _layout_fix(cfg: Config, spec: ModelSpec, *, world_size: int, device_bytes: int, te: bool,
                beside: tuple[int, int, int, int]) -> str:
    """Name the first trainer layout that fits (:func:`fitting_layouts`), or say that none does, and
    why none can where the bytes say so: the trainer state's floor alone (the train phase), or the
    params' floor in the sync phase beside ``beside`` (the lightest engine set's TP and weights, the
    weight push, the CUDA contexts of the trainer and that one set): there the trainer keeps its
    params alone."""
    layouts = fitting_layouts(cfg, spec, world_size=world_size, device_bytes=device_bytes, te=te)
    if not layouts:
        n = hf_param_count(spec)  # every weight split world_size ways
        floor = (BF16 + FP32 + 3 * FP32) * n / world_size
        state = (f"bf16 weights, fp32 grads, fp32 main weights and Adam moments, 18 bytes per parameter, are "
                 f"{gb(floor)} GB per GPU over {world_size} GPUs at best")
        dtype = cfg.trainer.params_dtype
        params_floor = (BF16 if dtype == "bf16" else FP32) * n / world_size
        params = (f"{dtype} weights, {BF16 if dtype == 'bf16' else FP32} bytes per parameter, are "
                  f"{gb(params_floor)} GB per GPU over {world_size} GPUs at best")
        tp, weights, push, contexts = beside
        sync = params_floor + weights + push + contexts
        why = (f", nor can one: {state}: more GPUs" if floor > device_bytes else
               f", nor can one: in the sync phase the trainer params ({params}) sit beside the engine weights "
               f"(TP {tp}, the lightest built: {gb(weights)} GB), the weight push ({gb(push)} GB) and the CUDA "
               f"contexts ({gb(contexts)} GB): {gb(sync)} GB > {gb(device_bytes)} GB: more GPUs"
               if sync > device_bytes else "")
        return "; no trainer.tp/pp/ep layout fits with the rest as it is" + why
    tp, pp, ep, min_tp = layouts[0]
    also = [*(["trainer.stream=false"] if ep > 1 and cfg.trainer.stream else []),
            *([f"scheduler.planner.min_tp={min_tp} (rollout.tp, short_tp and long_tp >= it)"] if min_tp else [])]
    return (f"; or the layout trainer.tp={tp} trainer.pp={pp} trainer.ep={ep}"
            + (f" with {' and '.join(also)}" if also else "") + ", which fits")


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


def _train_fixes(cfg: Config, spec: ModelSpec, worst_stage: Callable[..., StagePeak], longest: int, *,
                 world_size: int, budget: int) -> str:
    """What would make the trainer fit in ``budget`` bytes, each checked against the same model."""
    t = cfg.trainer
    fixes = []
    if spec.is_moe:  # a larger ep divides the experts' params and grads (their optimizer shard stays)
        eps = [ep for ep in expert_parallel_sizes(spec, world_size // (t.tp * t.pp * t.cp) * t.cp) if ep > t.ep]
        enough = [ep for ep in eps if worst_stage(t.recompute, ep=ep).total <= budget]
        if eps:
            ep = enough[0] if enough else eps[-1]
            fixes.append(f"trainer.ep={ep}{' with trainer.stream=false' if t.stream else ''} (trainer state "
                         f"{gb(worst_stage(t.recompute, ep=ep).state.total)} GB"
                         + (")" if enough else ", not enough alone)"))
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
    fixes.append("a higher trainer.tp (sequence parallel for MoE: divides the log-prob buffers, the experts' params "
                 "and all activations but the experts' routed rows) or trainer.cp"
                 if spec.is_moe else "a higher trainer.tp or trainer.cp (both divide activations and log-prob buffers)")
    return "; or ".join(fixes)


def expert_parallel_sizes(spec: ModelSpec, dp_cp: int) -> list[int]:
    """The trainer.ep sizes a layout with ``dp_cp = world / (tp * pp)`` ranks per model replica allows:
    those dividing both num_experts and dp_cp (1 alone for a dense model)."""
    return [ep for ep in range(1, dp_cp + 1) if dp_cp % ep == 0 and (spec.num_experts % ep == 0 if spec.is_moe
                                                                      else ep == 1)]


def check_expert_parallel(cfg: Config, spec: ModelSpec | None, world_size: int) -> None:
    """Refuse a ``trainer.ep`` the layout or the model cannot be split by, naming it and the sizes that work.

    Megatron builds the experts' grid as ep x tp (expert_tensor_parallel_size = tp) x expert DP x pp
    over the whole world, so ep must divide ``world_size / (tp * pp)``, and whole experts per EP rank,
    so it must divide ``num_experts``; a dense model has no experts to split. ``spec`` None: the model
    is not known yet (only the world is checked). rollpacker.config.check_layout refuses the same
    layouts on every start; this is the plan's own check, for its command line and callers.
    """
    t, src = cfg.trainer, cfg.source or "config"
    if t.ep == 1:
        return
    if spec is not None and not spec.is_moe:
        raise ConfigError(f"{src}: trainer.ep={t.ep} needs a mixture-of-experts model, and {cfg.model.path} is a "
                          f"dense {spec.model_type} model; set trainer.ep=1")
    ranks = t.tp * t.pp
    if world_size % ranks or (world_size // ranks) % t.ep:
        sizes = (f"among {expert_parallel_sizes(spec, world_size // ranks)}" if spec and not world_size % ranks
                 else f"dividing {world_size // ranks}" if not world_size % ranks
                 else "with tp*pp dividing the world size")
        raise ConfigError(f"{src}: trainer.ep={t.ep} does not divide world size / (trainer.tp*trainer.pp) = "
                          f"{world_size}/({t.tp}*{t.pp}) = {world_size / ranks:g}, as Megatron's expert grid "
                          f"(ep x tp x expert data parallel x pp over the world) needs; choose trainer.ep {sizes}")
    if spec is not None and spec.num_experts % t.ep:
        raise ConfigError(f"{src}: trainer.ep={t.ep} does not divide the model's num_experts={spec.num_experts} "
                          f"(each EP rank holds whole experts); choose trainer.ep among "
                          f"{expert_parallel_sizes(spec, world_size // ranks)}")


def fitting_layouts(cfg: Config, spec: ModelSpec, *, world_size: int, device_bytes: int,
                    te: bool = True) -> list[tuple[int, int, int, int | None]]:
    """Every trainer (tp, pp, ep) whose memory plan fits, trainer.cp and the rest of ``cfg`` as they are
    or, where the sync phase fits only beside larger engines, with ``scheduler.planner.min_tp`` raised
    to the fourth value (None: as it is). Only layouts check_layout would accept (heads, KV heads and
    FFN widths, a mixture-of-experts model's expert width too, split by tp; layers by pp; the batch by
    dp; ep dividing the experts and world / (tp * pp), with trainer.stream=false where ep > 1); a
    mixture-of-experts model at tp > 1 is planned under sequence parallelism, as the trainer runs it;
    the least split first: no pipeline, then the smallest tp, then the smallest ep."""
    t, planner, batch = cfg.trainer, cfg.scheduler.planner, cfg.scheduler.p0 * cfg.scheduler.r0
    found: list[tuple[int, int, int, int | None]] = []
    for pp in (n for n in range(1, spec.num_layers + 1) if spec.num_layers % n == 0):
        for tp in range(1, world_size + 1):
            if world_size % (tp * pp * t.cp) or batch % (world_size // (tp * pp * t.cp)):
                continue
            try:
                spec.check_tp(tp)
            except ValueError:
                continue
            for ep in expert_parallel_sizes(spec, world_size // (tp * pp)):
                trial = replace(cfg, trainer=replace(t, tp=tp, pp=pp, ep=ep))
                plan = plan_memory(trial, spec, world_size=world_size, device_bytes=device_bytes, te=te,
                                   fixes=False)
                if plan.fits:
                    found.append((tp, pp, ep, None))
                    continue
                if not planner.enabled:
                    continue
                # fewer, larger engine sets: less engine weight and fewer CUDA contexts beside the trainer's
                # params in the sync phase
                for min_tp in (e.tp for e in plan.engines if e.tp > planner.min_tp):
                    fewer = replace(trial, scheduler=replace(cfg.scheduler, planner=replace(planner, min_tp=min_tp)))
                    if plan_memory(fewer, spec, world_size=world_size, device_bytes=device_bytes, te=te,
                                   fixes=False).fits:
                        found.append((tp, pp, ep, min_tp))
                        break
    return found


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
                   help="default: the published run's (2/4/8 for Qwen2.5-7B/14B/32B, 1 for Qwen3-8B "
                        "and Qwen3-30B-A3B), else 1")
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
