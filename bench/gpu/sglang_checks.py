"""The SGLang half of the GPU acceptance run (see bench/gpu/acceptance.py): the production rollout
engine through our backend (``SGLangEngine``: an engine host process per engine, our server
arguments), on the device under test.

``check_engine`` starts one engine and runs, in order, what a training run relies on:

* ``kv``: the engine's KV pool (``max_total_num_tokens``) against the memory plan's prediction for
  this model at ``rollout.mem_fraction_static`` (``rollpacker.plan_sizes``). sglang sizes the pool as the
  memory free after loading the weights less ``(1 - mem_fraction_static)`` of the device
  (``model_runner``'s ``profile_max_num_token``), so on an otherwise empty GPU it lands a CUDA
  context and sglang's own buffers below the plan; a plan that over-predicts by more than 5% would
  let the preflight pass configs that do not fit. On CPU the pool is ``rollout.kv_cache_tokens``
  exactly (``max_total_tokens``).
* ``greedy``: greedy tokens against transformers in fp32. On CPU the engine computes in fp32 and
  exact token equality is the bar. On a GPU it runs in bf16, as training does, so that the check
  costs one engine start (each start on a fresh machine JIT-compiles sglang's RoPE kernel, and an
  fp32 start that sglang refuses would cost a second one): every divergence must then sit at a
  near-tie of the fp32 reference: at the first differing position the reference's logit for its own
  token may exceed the engine's token's logit by at most ``BF16_TIE_MARGIN``. (bf16 keeps 8 mantissa
  bits; the trainer's bf16 log-probs measured a mean error of 0.0097 against fp32 on the 0.5B shape,
  docs/gpu/2026-11-23-h100: 0.1 is ten times that.)
* ``routing`` (a MoE model): the engine started with ``rollout.return_routing``; at every position
  the greedy requests fed and every sparse layer, the experts sglang reports against those
  transformers' router (fp32, on the same tokens) chooses: the same set, and the same order. Replay
  uses the set; the order (descending weight on sglang's CPU path) is measured here for the GPU's
  Triton gate. A bf16 engine can flip a near-tie, so the bar is a share, ``ROUTING_SET_SHARE``.
* ``push``: trainer tensors (the Megatron trainer on the same device, weights perturbed) pushed
  through ``SGLangEngine.update_weights`` (CUDA IPC handles to the engine host on a GPU), then the
  greedy check again against transformers loaded with the same tensors; the perturbation must change
  the output, or the check would prove nothing.
* ``release``: ``release_memory`` / ``resume_memory`` of every tag, with the bytes freed and taken
  back measured by ``torch.cuda.mem_get_info`` (device-wide, so the engine's processes count); after
  the resume the weights are pushed again, as the program does after each train phase, and the
  greedy output must be what it was before the release. On CPU nothing is freed (sglang's memory
  saver is CUDA-only) and only the output is checked.

``check_throughput`` measures decode tokens/s by batch size for sglang and the reference engine on
the same prompts in the same process, one after the other.

``progress``, where given, receives the result so far after each stage of ``check_engine``: a check
killed at its time limit (``bench/gpu/run.py``) keeps the stages that finished.
"""
from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from bench.gpu.rollout_checks import drain, drain_completions, hf_greedy, hf_model
from bench.gpu.trainer_checks import Subject, trainer_config
from rollpacker.hf_spec import ModelSpec, parse_spec
from rollpacker.plan_sizes import FP32, BF16, engine_weight_bytes, kv_bytes_per_token
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import Completion, GenerationRequest, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from testkit import free_base_port, hf_router_topk
from rollpacker.trainer.trainer import Trainer

BF16_TIE_MARGIN = 0.1  # nats; module docstring
KV_PLAN_BAND = (0.85, 1.05)  # engine KV tokens / planned; module docstring
RELEASE_SHARE = 0.8  # of what the engine took at start, release must give back (CUDA contexts stay)
# positions x sparse layers whose top-k set must equal the fp32 router's (module docstring); the random
# MoE's routers are scaled up to keep their choices clear of near-ties (testkit.make_random_checkpoint)
ROUTING_SET_SHARE = 0.95
GPU_MEM_FRACTION = 0.5  # leaves room for the trainer on the same GPU during the push check


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _completions(engine, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0) -> dict[str, Completion]:
    engine.submit([GenerationRequest(f"r{i}", p, SamplingParams(temperature=temperature, max_new_tokens=new_tokens,
                                                                seed=i))
                   for i, p in enumerate(prompts)])
    return drain_completions(engine)


def _generate(engine, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0) -> dict[str, list[int]]:
    return _tokens(_completions(engine, prompts, new_tokens, temperature))


def _tokens(done: dict[str, Completion]) -> dict[str, list[int]]:
    return {rid: list(c.output_ids) for rid, c in done.items()}


def compare_routing(model, prompts: list[list[int]], done: dict[str, Completion], spec: ModelSpec) -> dict[str, Any]:
    """The engine's reported routing against transformers' routers on the same tokens (module docstring)."""
    width = (len(spec.moe_layers), spec.experts_per_token)
    total = same_set = same_order = wrong_length = 0
    for i, p in enumerate(prompts):
        c = done[f"r{i}"]
        # the last output token is never fed
        want = hf_router_topk(model, [*p, *c.output_ids][:-1], spec.moe_layers, spec.experts_per_token)
        if len(c.routed_experts) != want.numel():
            wrong_length += 1
            continue
        got = torch.tensor(list(c.routed_experts), dtype=want.dtype).view(-1, *width)
        total += got.shape[0] * got.shape[1]
        same_order += int((got == want).all(-1).sum())
        same_set += int((got.sort(-1).values == want.sort(-1).values).all(-1).sum())
    return {"positions_x_layers": total, "same_set": same_set, "same_order": same_order,
            "wrong_length_requests": wrong_length,
            "ok": wrong_length == 0 and total > 0 and same_set >= ROUTING_SET_SHARE * total}


def _start(subject: Subject, cfg: RolloutConfig, dtype: str):
    from rollpacker.rollout.sglang_backend import SGLangEngine
    return SGLangEngine(subject.model_dir, cfg, device=str(subject.device), dtype=dtype)


def compare_greedy(model, prompts: list[list[int]], got: dict[str, list[int]], want: list[list[int]],
                   exact: bool) -> dict[str, Any]:
    """Token equality with the reference; in bf16 (``exact`` False), the margin at each divergence."""
    equal = sum(a == b for i, w in enumerate(want) for a, b in zip(got[f"r{i}"], w))
    margins = []
    for i, (p, w) in enumerate(zip(prompts, want)):
        k = next((k for k, (a, b) in enumerate(zip(got[f"r{i}"], w)) if a != b), None)
        if k is None:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([p + w[:k]], device=model.device)).logits[0, -1].float()
        margins.append(float(logits[w[k]] - logits[got[f"r{i}"][k]]))
    total = sum(len(w) for w in want)
    out = {"tokens": total, "equal_tokens": equal, "divergences": len(margins),
           "max_tie_margin": max(margins, default=0.0)}
    out["ok"] = equal == total if exact else all(m <= BF16_TIE_MARGIN for m in margins)
    return out


def _with_weights(model, subject: Subject, tensors: dict[str, torch.Tensor]):
    """transformers' model with ``tensors`` (checkpoint names) loaded. transformers 5 fuses a MoE
    model's experts into one tensor per layer, so their per-expert checkpoint names are not its
    parameters: a model they would not load into is read again from a copy of the checkpoint with them,
    through ``from_pretrained``'s own conversion."""
    if not model.load_state_dict(tensors, strict=False).unexpected_keys:
        return model
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(subject.model_dir / "config.json", tmp)
        state = {}
        for file in sorted(subject.model_dir.glob("*.safetensors")):
            state.update(load_file(str(file)))
        save_file({**state, **tensors}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        return hf_model(Path(tmp), subject.device)


def _perturb(trainer: Trainer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            p.add_(noise * 0.3 * p.float().std().clamp_min(1e-3).to(p.dtype))


def _planned_kv_tokens(subject: Subject, cfg: RolloutConfig, dtype: str) -> int:
    if not subject.cuda:
        return cfg.kv_cache_tokens
    spec = parse_spec(subject.model_dir)
    width = FP32 if dtype == "float32" else BF16
    static = cfg.mem_fraction_static * torch.cuda.get_device_properties(subject.device).total_memory
    return int((static - engine_weight_bytes(spec, 1, width)) // kv_bytes_per_token(spec, 1, width))


def check_engine(subject: Subject, prompts: int = 8, new_tokens: int = 32,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One sglang engine on the device: KV vs the plan, greedy parity, weight push, release/resume."""
    spec = parse_spec(subject.model_dir)
    batch = _prompts(spec.vocab_size, prompts, seed=7)
    cfg = RolloutConfig(backend="sglang", kv_cache_tokens=8192, sglang_base_port=free_base_port(1),
                        mem_fraction_static=GPU_MEM_FRACTION if subject.cuda else 0.05, return_routing=spec.is_moe)
    free_before = _free_bytes(subject.device)
    dtype = "bfloat16" if subject.cuda else "float32"
    result: dict[str, Any] = {"dtype": dtype}
    t0 = time.perf_counter()
    engine = _start(subject, cfg, dtype)
    result["start_s"] = time.perf_counter() - t0
    stage = progress or (lambda _: None)
    stage(result)
    with contextlib.ExitStack() as stack:
        stack.callback(engine.shutdown)
        free_started = _free_bytes(subject.device)
        capacity, planned = engine.stats().kv_tokens_capacity, _planned_kv_tokens(subject, cfg, dtype)
        ratio = capacity / planned
        result["kv"] = {"engine_tokens": capacity, "planned_tokens": planned, "ratio": ratio,
                        "ok": (KV_PLAN_BAND[0] <= ratio <= KV_PLAN_BAND[1]) if subject.cuda else capacity == planned}
        stage(result)

        model = hf_model(subject.model_dir, subject.device)
        want = hf_greedy(model, batch, new_tokens)
        done = _completions(engine, batch, new_tokens)
        result["greedy"] = compare_greedy(model, batch, _tokens(done), want,
                                          exact=dtype == "float32")
        stage(result)
        if spec.is_moe:
            result["routing"] = compare_routing(model, batch, done, spec)
            stage(result)

        trainer = Trainer(trainer_config(subject), subject.model_dir, subject.layout)
        _perturb(trainer, seed=3)
        pushed = [(n, t.detach().float().cpu()) for n, t in trainer.iter_hf_tensors()]
        model = _with_weights(model, subject, dict(pushed))
        want_after = hf_greedy(model, batch, new_tokens)
        t0 = time.perf_counter()
        engine.update_weights(trainer.iter_hf_tensors())
        push_s = time.perf_counter() - t0
        after = _generate(engine, batch, new_tokens)
        result["push"] = {**compare_greedy(model, batch, after, want_after, exact=dtype == "float32"),
                          "seconds": push_s, "bytes": sum(t.numel() * t.element_size() for _, t in pushed),
                          "changes_output": want_after != want}
        result["push"]["ok"] = result["push"]["ok"] and result["push"]["changes_output"]
        stage(result)

        free_loaded = _free_bytes(subject.device)
        engine.release_memory()
        free_released = _free_bytes(subject.device)
        engine.resume_memory()
        free_resumed = _free_bytes(subject.device)
        engine.update_weights(trainer.iter_hf_tensors())
        again = _generate(engine, batch, new_tokens)
        release: dict[str, Any] = {"output_unchanged": again == after}
        if subject.cuda:
            held = free_before - free_started
            release.update(engine_held_bytes=held, freed_bytes=free_released - free_loaded,
                           taken_back_bytes=free_released - free_resumed)
            release["ok"] = release["output_unchanged"] and release["freed_bytes"] >= RELEASE_SHARE * held
        else:
            release["ok"] = release["output_unchanged"]
        result["release"] = release
        del trainer, model
    result["ok"] = all(part["ok"] for part in result.values() if isinstance(part, dict))
    return result


def _timed(engine, reqs: Iterable[GenerationRequest]) -> tuple[int, float]:
    t0 = time.perf_counter()
    engine.submit(list(reqs))
    out = drain(engine)
    return sum(len(v) for v in out.values()), time.perf_counter() - t0


def check_throughput(subject: Subject, batches: list[int], new_tokens: int, prompt_tokens: int = 64) -> dict[str, Any]:
    """Decode tokens/s of sglang and of the reference engine on the same requests (sampling, no EOS),
    by batch size; the first batch runs twice on each engine, its first run warming kernels up."""
    vocab = parse_spec(subject.model_dir).vocab_size
    rng = random.Random(8)
    work = {b: [GenerationRequest(f"b{b}r{i}", [rng.randrange(vocab) for _ in range(prompt_tokens)],
                                  SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i))
                for i in range(b)] for b in batches}
    kv = max(batches) * (prompt_tokens + new_tokens + 16)
    cfg = RolloutConfig(backend="sglang", kv_cache_tokens=kv, max_running_requests=max(batches),
                        max_prefill_tokens=16384, sglang_base_port=free_base_port(1),
                        mem_fraction_static=GPU_MEM_FRACTION if subject.cuda else 0.05)
    dtype = torch.bfloat16 if subject.cuda else torch.float32
    measured: dict[str, dict[int, tuple[int, float]]] = {}
    engines = {"reference": lambda: ReferenceEngine(subject.model_dir, cfg, device=subject.device, dtype=dtype),
               "sglang": lambda: _start(subject, cfg, "bfloat16" if subject.cuda else "float32")}
    for name, make in engines.items():
        engine = make()
        try:
            _timed(engine, work[batches[0]])
            measured[name] = {b: _timed(engine, work[b]) for b in batches}
        finally:
            engine.shutdown()
        if subject.cuda:
            torch.cuda.empty_cache()
    rows = []
    for b in batches:
        (sg_tokens, sg_s), (ref_tokens, ref_s) = measured["sglang"][b], measured["reference"][b]
        rows.append({"batch": b, "tokens_per_s": sg_tokens / sg_s, "seconds": sg_s,
                     "reference_tokens_per_s": ref_tokens / ref_s,
                     "sglang_over_reference": (sg_tokens / sg_s) / (ref_tokens / ref_s)})
    complete = all(measured[n][b][0] == b * new_tokens for n in measured for b in batches)
    return {"dtype": str(dtype), "prompt_tokens": prompt_tokens, "rows": rows, "ok": complete}
