"""The trainer half of the GPU acceptance run (see bench/gpu/acceptance.py).

Each check takes a :class:`Subject` (a model directory on one device) and returns a
dict of figures with an ``ok`` verdict. On CUDA the backend under test is
``GpuBackend`` (Megatron DDP, distributed optimizer, Megatron's schedule, packed
THD micro-batches); on CPU it is ``CpuBackend``, so the dry run exercises the same
code up to the backend.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_ext.parallel import ParallelLayout
from megatron_ext.sdpa_attention import packed_attention_paths, uses_sdpa_attention
from rollpacker.hf_spec import parse_spec
from rollpacker.sample import Prompt, Sample
from rollpacker.trainer.backend import logprobs_only, micro_batch_loss
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.grpo import denominator
from rollpacker.trainer.packing import build_micro_batch, plan_micro_batches
from rollpacker.trainer.stream import with_advantages
from rollpacker.trainer.trainer import Trainer

# H100/H200 SXM dense bf16 peak (NVIDIA's datasheet), for MFU.
PEAK_BF16_FLOPS = 989.4e12

# Qwen2.5-7B's published config.json widths with 4 of its 28 layers (random weights: nothing is downloaded):
# the trainer's MFU at a real model's matmul sizes on one GPU (about 2.0B parameters, 1.1B of them the
# untied embedding and output layer). Goal on an H100: >= 35% MFU at 8,192-token micro-batches.
QWEN25_7B_WIDTHS_4L = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=4,
                           num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


@dataclass
class Subject:
    name: str
    model_dir: Path
    device: torch.device
    layout: ParallelLayout
    dtype: str  # trainer params dtype: "bf16" on CUDA, "fp32" on CPU
    lr: float

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def trainer_config(subject: Subject, **changes: Any) -> TrainerConfig:
    cfg = TrainerConfig(lr=subject.lr, params_dtype=subject.dtype, micro_batch_tokens=16384, stream=False,
                        grad_clip=1.0)
    return replace(cfg, **changes)


def make_groups(model_dir: Path, seed: int, *, groups: int = 2, size: int = 4, prompt: tuple[int, int] = (8, 24),
                response: tuple[int, int] = (4, 48)) -> list[list[Sample]]:
    """Random prompt groups over the model's vocabulary, rewards 0/1 (each group holds both)."""
    vocab = parse_spec(model_dir).vocab_size
    rng = random.Random(seed)
    out = []
    for uid in range(groups):
        p = Prompt(uid=uid, input_ids=[rng.randrange(vocab) for _ in range(rng.randint(*prompt))],
                   data_source="synthetic")
        out.append([Sample(prompt=p, response_index=i, reward=float(i % 2), finish_reason="stop",
                           response_ids=[rng.randrange(vocab) for _ in range(rng.randint(*response))])
                    for i in range(size)])
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def trainer_response_logprobs(trainer: Trainer, samples: list[Sample]) -> list[torch.Tensor]:
    """Per sample, the trainer's log-probs of its response tokens (forward only, one micro-batch)."""
    backend = trainer.backend
    samples = [s.replace(advantage=0.0) for s in samples]  # the layout needs one; log-probs ignore it
    mb = build_micro_batch(samples, aggregation="token_mean", layout=backend.micro_batch_layout,
                           pad_multiple=backend.pad_multiple)
    fn = partial(logprobs_only, tp_group=trainer.layout.tp_group, vocab_size=backend.vocab_size)
    with torch.no_grad():
        [lp] = backend.forward_backward([mb], fn, forward_only=True)
    lp, mask = lp.float().cpu(), mb.loss_mask.cpu() > 0
    out = []
    for i, s in enumerate(samples):
        n = len(s.prompt.input_ids) + len(s.response_ids)
        row, start = (0, int(mb.cu_seqlens[i])) if mb.layout == "thd" else (i, 0)
        out.append(lp[row, start:start + n][mask[row, start:start + n]])
    return out


def hf_response_logprobs(model_dir: Path, samples: list[Sample], device: torch.device,
                         dtype: torch.dtype) -> list[torch.Tensor]:
    """The same log-probs from transformers' Qwen2ForCausalLM (the reference implementation)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt.input_ids + s.response_ids], device=device)
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)
            lp = logp.gather(1, ids[0, 1:, None])[:, 0]
            out.append(lp[len(s.prompt.input_ids) - 1:].cpu())
    del model
    return out


def _abs_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return float(d.max()), float(d.mean())


def check_logprob_parity(subject: Subject) -> dict[str, Any]:
    """Trainer log-probs against transformers in fp32; in bf16, within twice transformers' own bf16 error."""
    samples = [s for g in make_groups(subject.model_dir, 1) for s in g]
    trainer = Trainer(trainer_config(subject), subject.model_dir, subject.layout)
    ours = trainer_response_logprobs(trainer, samples)
    del trainer
    truth = hf_response_logprobs(subject.model_dir, samples, subject.device, torch.float32)
    max_err, mean_err = _abs_err(ours, truth)
    result = {"tokens": sum(len(x) for x in truth), "max_abs_err_vs_hf_fp32": max_err,
              "mean_abs_err_vs_hf_fp32": mean_err}
    if subject.dtype == "bf16":
        hf16 = hf_response_logprobs(subject.model_dir, samples, subject.device, torch.bfloat16)
        floor_max, floor_mean = _abs_err(hf16, truth)
        result.update(hf_bf16_max_abs_err=floor_max, hf_bf16_mean_abs_err=floor_mean,
                      ok=mean_err <= 2 * floor_mean + 1e-4 and max_err <= 2 * floor_max + 1e-3)
    else:
        result["ok"] = max_err < 1e-4
    return result


# -- gradients ---------------------------------------------------------------------------------------------

def step_gradients(trainer: Trainer, groups: list[list[Sample]]) -> dict[str, torch.Tensor]:
    """One GRPO step's reduced, normalised gradients (before clipping and the update), on host, by name."""
    backend, cfg = trainer.backend, trainer.cfg
    samples = [s for g in groups for s in with_advantages(g, cfg)]
    mbs = plan_micro_batches(samples, budget=cfg.micro_batch_tokens, aggregation=cfg.loss_aggregation,
                             layout=backend.micro_batch_layout, pad_multiple=backend.pad_multiple)
    backend.zero_grad()
    backend.forward_backward(mbs, partial(micro_batch_loss, cfg=cfg, tp_group=trainer.layout.tp_group,
                                          vocab_size=backend.vocab_size))
    denom = denominator(sum(len(s.response_ids) for s in samples), len(samples), cfg.loss_aggregation)
    backend.reduce_grads(1.0 / denom)
    # Megatron DDP accumulates into ``main_grad`` (fp32 buffer views); the CPU backend into ``grad``.
    return {n: (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad)
            .detach().float().cpu().clone() for n, p in backend.model.named_parameters()}


def cpu_reference_gradients(model_dir: Path, out: Path, seed: int) -> None:
    """Entry of the CPU subprocess: the fp32 CPU backend's gradients for the same step."""
    from megatron_ext.parallel import setup_layout
    layout = setup_layout()
    subject = Subject("cpu", model_dir, torch.device("cpu"), layout, "fp32", 1e-5)
    trainer = Trainer(trainer_config(subject), model_dir, layout)
    torch.save(step_gradients(trainer, make_groups(model_dir, seed)), out)


def check_gradient_parity(subject: Subject, work: Path) -> dict[str, Any]:
    """One GRPO step's gradients: this device's backend (its dtype, and fp32) against the CPU fp32 backend."""
    ref_file = work / f"{subject.name}_cpu_grads.pt"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "bench.gpu.acceptance", "grad-reference", str(subject.model_dir),
                    str(ref_file), "--seed", "2"], check=True, env=env, cwd=Path(__file__).resolve().parents[2])
    reference = torch.load(ref_file)
    result: dict[str, Any] = {"cpu_reference_s": time.perf_counter() - t0, "ok": True}
    for dtype in dict.fromkeys([subject.dtype, "fp32"]):
        trainer = Trainer(trainer_config(subject, params_dtype=dtype), subject.model_dir, subject.layout)
        grads = step_gradients(trainer, make_groups(subject.model_dir, 2))
        del trainer
        if grads.keys() != reference.keys():
            raise AssertionError(f"parameter names differ: {sorted(grads.keys() ^ reference.keys())[:4]}")
        flat_ours = torch.cat([grads[n].flatten() for n in reference])
        flat_ref = torch.cat([reference[n].flatten() for n in reference])
        rel = float((flat_ours - flat_ref).norm() / flat_ref.norm())
        cosine = float(torch.nn.functional.cosine_similarity(flat_ours.double(), flat_ref.double(), dim=0))
        worst = max(reference, key=lambda n: float((grads[n] - reference[n]).norm() / (reference[n].norm() + 1e-30)))
        worst_rel = float((grads[worst] - reference[worst]).norm() / (reference[worst].norm() + 1e-30))
        bound = 1e-3 if dtype == "fp32" else 5e-2
        result[dtype] = {"rel_l2_err": rel, "cosine": cosine, "worst_param": worst, "worst_param_rel_err": worst_rel,
                         "grad_norm": float(flat_ref.norm()), "bound": bound}
        result["ok"] &= rel < bound
    return result


# -- training ----------------------------------------------------------------------------------------------

def check_loss_falls(subject: Subject, steps: int) -> dict[str, Any]:
    """A few GRPO steps on one batch: with the behaviour log-probs fixed at the first policy's, the
    clipped surrogate loss must fall as the policy moves towards positive advantages."""
    groups = make_groups(subject.model_dir, 3)
    trainer = Trainer(trainer_config(subject, old_logprobs="engine"), subject.model_dir, subject.layout)
    flat = [s for g in groups for s in g]
    behaviour = trainer_response_logprobs(trainer, flat)
    behaviour_groups, k = [], 0
    for g in groups:
        behaviour_groups.append([s.replace(rollout_logprobs=behaviour[k + i].tolist()) for i, s in enumerate(g)])
        k += len(g)
    losses, norms = [], []
    for _ in range(steps):
        m = trainer.train_step(behaviour_groups)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    del trainer
    # Once most ratios reach the clip range the surrogate plateaus and wobbles; the verdict asks for
    # a clear fall from the first step, not monotonicity.
    return {"losses": losses, "grad_norms": norms, "ok": losses[-1] < losses[0] - 0.02}


def _allocated(device: torch.device) -> int:
    _sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def expected_resident_bytes(trainer: Trainer) -> int:
    """What offload claims to move: DDP param/grad buffers plus the optimizer's fp32 state."""
    backend = trainer.backend
    if not hasattr(backend, "ddp"):
        return 0
    total = sum(b.param_data.numel() * b.param_data.element_size() + b.grad_data.numel() * b.grad_data.element_size()
                for b in backend.ddp.buffers + backend.ddp.expert_parallel_buffers)
    for opt in backend.optimizer.chained_optimizers:
        for state in opt.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)
                         and t.device.type == "cuda")
        for group in getattr(opt, "shard_fp32_from_float16_groups", []):
            total += sum(p.numel() * p.element_size() for p in group)
    return total


def check_offload_and_state(subject: Subject) -> dict[str, Any]:
    """Offload/onload move what they claim; optimizer state saved after one step and loaded into a fresh
    trainer continues exactly as the original does."""
    groups = make_groups(subject.model_dir, 4)
    cfg = trainer_config(subject, lr=1e-3)  # a large step, so a lost Adam moment would show
    first = Trainer(cfg, subject.model_dir, subject.layout)
    first.train_step(groups)
    before, claimed = _allocated(subject.device), expected_resident_bytes(first)
    offloaded = first.offload()
    after_offload = _allocated(subject.device)
    onloaded = first.onload()
    after_onload = _allocated(subject.device)
    freed = before - after_offload
    result: dict[str, Any] = {
        "allocated_before": before, "allocated_after_offload": after_offload, "allocated_after_onload": after_onload,
        "claimed_bytes": claimed, "reported_bytes": offloaded.bytes, "freed_bytes": freed,
        "offload_s": offloaded.seconds, "onload_s": onloaded.seconds}
    memory_ok = onloaded.bytes == offloaded.bytes
    if subject.cuda:
        memory_ok &= (abs(freed - claimed) <= 0.02 * claimed and abs(offloaded.bytes - claimed) <= 0.02 * claimed
                      and abs(after_onload - before) <= 0.01 * before)
    state = first.state_dict()
    first.train_step(groups)
    expected = first.backend.optimizer_state_dict()
    del first
    second = Trainer(cfg, subject.model_dir, subject.layout)
    second.load_state_dict(state)
    second.train_step(groups)
    worst, where = _max_tensor_diff(expected, second.backend.optimizer_state_dict())
    del second
    result.update(optimizer_state_max_abs_diff=worst, optimizer_state_worst_entry=where,
                  ok=memory_ok and worst <= 1e-6)
    return result


def _max_tensor_diff(a: Any, b: Any, path: str = "") -> tuple[float, str]:
    """The largest |a - b| over the tensors of two nested states, and where it is."""
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            return float("inf"), f"{path} (shape {tuple(a.shape)} vs {tuple(b.shape)})"
        return (float((a.double() - b.double()).abs().max()) if a.numel() else 0.0), path
    if isinstance(a, dict):
        pairs = [(a[k], b[k], f"{path}/{k}") for k in a if k in b]
    elif isinstance(a, (list, tuple)):
        pairs = [(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b))]
    else:
        return 0.0, path
    return max((_max_tensor_diff(x, y, p) for x, y, p in pairs), default=(0.0, path), key=lambda t: t[0])


def check_throughput(subject: Subject, tokens_per_micro_batch: int, micro_batches: int, *,
                     min_mfu: float | None = None, profile: Path | None = None,
                     **trainer_changes: Any) -> dict[str, Any]:
    """Trainer tokens/s and MFU: forward+backward of packed micro-batches of long-tailed sequences.

    ``trainer_changes``: TrainerConfig fields for this run (e.g. ``packed_attention="per_sequence"``,
    ``fused_swiglu=True``). ``min_mfu``: on CUDA the verdict also asks for at least this MFU.
    Reports which packed attention path the layers took (``attention_paths``: path -> layers).
    ``profile``: write torch.profiler's tables of two more micro-batches there, after the timing.
    """
    spec = parse_spec(subject.model_dir)
    rng = random.Random(5)
    trainer = Trainer(trainer_config(subject, micro_batch_tokens=tokens_per_micro_batch, **trainer_changes),
                      subject.model_dir, subject.layout)
    backend = trainer.backend
    samples, used = [], 0
    while used < tokens_per_micro_batch:
        n = min(int(rng.paretovariate(1.2) * 128), 4096, tokens_per_micro_batch - used)
        if n < 8:
            break
        p = Prompt(uid=len(samples), input_ids=[rng.randrange(spec.vocab_size) for _ in range(n // 4)],
                   data_source="synthetic")
        samples.append(Sample(prompt=p, response_index=0, reward=1.0, advantage=1.0,
                              response_ids=[rng.randrange(spec.vocab_size) for _ in range(n - n // 4)]))
        used += n
    mb = build_micro_batch(samples, aggregation="token_mean", layout=backend.micro_batch_layout,
                           pad_multiple=backend.pad_multiple)
    loss_fn = partial(micro_batch_loss, cfg=trainer.cfg, tp_group=trainer.layout.tp_group,
                      vocab_size=backend.vocab_size)
    trainer.train_step(make_groups(subject.model_dir, 6))  # Adam's moments exist from the first step on
    backend.zero_grad()
    backend.forward_backward([mb], loss_fn)  # warm-up (kernels, allocator)
    if subject.cuda:
        torch.cuda.reset_peak_memory_stats(subject.device)
    _sync(subject.device)
    t0 = time.perf_counter()
    outputs = [backend.forward_backward([mb], loss_fn) for _ in range(micro_batches)]
    _sync(subject.device)
    seconds = (time.perf_counter() - t0) / micro_batches
    # the timed work was the whole micro-batch each time: every response token counted, a finite loss
    loss_tokens = [float(sums.tokens) for out in outputs for sums in out]
    expected_tokens = sum(len(s.response_ids) for s in samples)
    complete = (len(loss_tokens) == micro_batches and all(t == expected_tokens for t in loss_tokens)
                and all(math.isfinite(float(sums.pg_loss)) for out in outputs for sums in out))
    lengths = [len(s.prompt.input_ids) + len(s.response_ids) for s in samples]
    flops = training_flops(subject.model_dir, lengths)
    mfu = flops / seconds / PEAK_BF16_FLOPS if subject.cuda else None
    result = {"tokens_per_micro_batch": mb.num_tokens, "sequences": len(samples), "seconds_per_micro_batch": seconds,
              "tokens_per_s": mb.num_tokens / seconds, "model_tflops_per_micro_batch": flops / 1e12, "mfu": mfu,
              "layers": spec.num_layers, "hidden_size": spec.hidden_size,
              "packed_attention": trainer.cfg.packed_attention, "fused_swiglu": trainer.cfg.fused_swiglu,
              "transformer_engine": not uses_sdpa_attention(backend.model),
              # path -> layers that took it in the last micro-batch; {} where nothing was packed (the CPU
              # backend's padded rows) or Transformer Engine's attention ran
              "attention_paths": packed_attention_paths(backend.model), "torch": torch.__version__}
    if subject.cuda:
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated(subject.device)
        result.update(_predicted_peak(spec, mb.num_tokens, subject.dtype))
    if profile is not None:
        _write_profile(profile, backend, mb, loss_fn, subject.device,
                       f"{spec.num_layers} layers, hidden {spec.hidden_size}: {seconds:.4f} s per micro-batch of "
                       f"{mb.num_tokens} tokens ({len(samples)} sequences), MFU {mfu}, attention paths "
                       f"{result['attention_paths']}")
    del trainer
    result.update(loss_tokens=loss_tokens, expected_loss_tokens=expected_tokens)
    result["ok"] = complete and (min_mfu is None or mfu is None or mfu >= min_mfu)
    if min_mfu is not None:
        result["min_mfu"] = min_mfu
    return result


def profile_tables(prof: Any, cuda: bool) -> str:
    """A torch.profiler run's operators by self device time (on CUDA) and by self CPU time."""
    averages = prof.key_averages()
    tables = ([averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)] if cuda
              else [])
    return "\n".join(tables + [averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)])


def _write_profile(path: Path, backend: Any, mb: Any, loss_fn: Any, device: torch.device, header: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            backend.forward_backward([mb], loss_fn)
        _sync(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{header}\n{profile_tables(prof, device.type == 'cuda')}\n")


def random_model_subject(work: Path, name: str, shape: dict[str, Any], device: torch.device, layout: ParallelLayout,
                         *, lr: float = 2e-5, seed: int = 11) -> Subject:
    """A subject over a random Qwen2 checkpoint of ``shape`` (HF config keys) in ``work/name``, written
    once (Qwen2.5-7B widths with 4 layers: about 8 GB of fp32 safetensors); bf16 on CUDA, fp32 on CPU."""
    from testkit import make_random_qwen2

    model_dir = work / name
    if not (model_dir / "config.json").exists() or not any(model_dir.glob("*.safetensors")):
        make_random_qwen2(model_dir, seed=seed, **shape)
    return Subject(name, model_dir, device, layout, "bf16" if device.type == "cuda" else "fp32", lr)


def check_throughput_7b_widths(work: Path, device: torch.device, layout: ParallelLayout, *,
                               tokens_per_micro_batch: int = 8192, micro_batches: int = 5,
                               shape: dict[str, Any] = QWEN25_7B_WIDTHS_4L, name: str = "qwen2.5-7b-widths-4l",
                               min_mfu: float | None = None, profile: Path | None = None,
                               **trainer_changes: Any) -> dict[str, Any]:
    """:func:`check_throughput` on a random model of Qwen2.5-7B's widths with 4 layers, 8,192-token packed
    micro-batches by default (``shape``/``name``: a small model for a CPU dry run)."""
    subject = random_model_subject(work, name, shape, device, layout)
    result = check_throughput(subject, tokens_per_micro_batch, micro_batches, min_mfu=min_mfu, profile=profile,
                              **trainer_changes)
    return {"shape": name, **result}


def training_flops(model_dir: Path, lengths: list[int]) -> float:
    """Model FLOPs of one forward+backward (Narayanan et al. 2021 accounting, causal attention halved):
    6 x matmul params x tokens, plus 6 x layers x heads x head_dim x sum(s^2) for QK^T and AV. A MoE
    layer counts its router and the top-k experts each token runs through (activated parameters)."""
    spec = parse_spec(model_dir)
    h, v = spec.hidden_size, spec.vocab_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    mlp = sum(h * spec.num_experts + 3 * h * spec.experts_per_token * spec.moe_intermediate_size
              if i in spec.moe_layers else 3 * h * spec.intermediate_size for i in range(spec.num_layers))
    # the output projection; the embedding is a lookup
    matmul_params = spec.num_layers * (h * (q + 2 * kv) + q * h) + mlp + v * h
    tokens = sum(lengths)
    attention = 6 * spec.num_layers * q * sum(s * s for s in lengths)
    return 6.0 * matmul_params * tokens + attention


def _predicted_peak(spec: Any, tokens: int, dtype: str) -> dict[str, Any]:
    """The memory plan's prediction of the trainer's peak, when the plan module offers one."""
    try:
        from rollpacker.plan_sizes import trainer_peak_bytes
    except ImportError:
        return {}
    try:
        import importlib.util
        te = importlib.util.find_spec("transformer_engine") is not None
        return {"predicted_trainer_peak_bytes": trainer_peak_bytes(spec, tp=1, micro_batch_tokens=tokens,
                                                                   recompute=False, dtype=dtype, te=te)}
    except TypeError as exc:  # keep the measurement even if the plan's signature moved
        return {"predicted_trainer_peak_error": str(exc)}


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
