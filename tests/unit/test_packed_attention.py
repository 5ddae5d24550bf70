"""Packed (THD) attention in one call per micro-batch equals one causal SDPA call per sequence.

``megatron_ext/packed_attention.py`` has two one-call kernels, and neither runs a backward
on this CPU: FlashAttention's varlen kernel (``varlen``, what ``auto`` picks on CUDA) has no
CPU kernel at all, and torch refuses FlexAttention's backward on CPU in its argument check
(``flex_attention._validate_device``) although the eager implementation behind it is
plain tensor arithmetic that differentiates anywhere. So here:

* ``flex`` runs for real (torch's eager FlexAttention, with the project's document-and-causal
  block mask), its CPU guard lifted for the gradient checks;
* ``varlen`` runs the project's own plumbing (the host -> device offsets, the span lengths,
  the GQA head expansion that torch 2.11's ``varlen_attn`` needs, the causal ``window_size``)
  into a stand-in for torch's kernel that keeps torch 2.11's signature and checks each
  argument against that contract. The FlashAttention kernel itself (and compiled
  FlexAttention) runs in the GPU acceptance run: ``bench/gpu/attention_checks.py`` against
  fp32 attention, and ``check_throughput`` in ``bench/gpu/trainer_checks.py``, which reports
  the path taken.

Errors measured on this machine (torch 2.13 CPU, GQA 4 query / 2 KV heads, head dim 16, 5
sequences of 1-23 real tokens in padded spans), max |diff| of the output / dq / dk / dv:
flex against per-sequence 4.8e-7 / 7.2e-7 / 9.5e-7 / 9.5e-7 in fp32 and 4.4e-16 / 1.6e-15 /
1.3e-15 / 2.7e-15 in fp64 (asserted: < 6e-6 and < 2e-14); the varlen plumbing 0 in both (the
stand-in is per-sequence arithmetic too). The shipped policy (4 layers) through either path
against per-sequence, max |diff| / max |reference|: logits 1.2e-6, parameter gradients 2.2e-6
flex and 1.9e-6 varlen (asserted: < 1e-5 and < 2e-5).

With the document mask broken on purpose (causal over the whole packed row, the span term
dropped) the flex output differed from per-sequence attention by 2.4 in fp32 (dq 2.3, dk 2.2,
dv 4.0), and only the first sequence, which has nothing before it, still agreed:
``test_a_mask_that_lets_sequences_see_each_other_is_caught`` keeps that failure checked.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_ext import packed_attention as pa
from megatron_ext.model import build_model
from megatron_ext.sdpa_attention import packed_attention_paths, set_packed_attention
from megatron_ext.weights import load_hf_checkpoint
from rollpacker.configlib import ConfigError
from testkit import REPO_ROOT
from rollpacker.trainer.config import TrainerConfig
from tests.dist.megatron_fixtures import layout  # noqa: F401  (pytest fixture)

HEADS, KV_HEADS, DIM = 4, 2, 16
REAL = [7, 1, 23, 12, 4]  # real tokens of each sequence
PAD = [1, 3, 1, 0, 4]  # padding after each one (a padded span, as cu_seqlens_q_padded gives)
# Measured max |diff| (see the module docstring) and the bounds asserted: at most 10x the measured figure.
BOUND = {torch.float32: 6e-6, torch.float64: 2e-14}


@pytest.fixture(autouse=True)
def fresh_packing():
    """Every test builds its own cu_seqlens; drop the one kept from a previous test."""
    pa._last_packing.clear()
    yield
    pa._last_packing.clear()


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Lift torch's CPU refusal of FlexAttention's backward (its eager backward is dense math)."""
    from torch.nn.attention import flex_attention
    monkeypatch.setattr(flex_attention, "_validate_device", lambda *args: None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")  # eager is the point here
        yield


def packed_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    spans = [r + p for r, p in zip(REAL, PAD)]
    tokens = sum(spans)
    q, k, v = (torch.randn(tokens, h, DIM, generator=gen, dtype=dtype).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32)
    grad_out = torch.randn(tokens, HEADS, DIM, generator=gen, dtype=dtype)
    return q, k, v, cu, grad_out


def run(path: str, q, k, v, cu, grad_out, **kwargs):
    pa._last_packing.clear()
    out = pa.packed_causal_attention(q, k, v, cu, path=path, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return (out.detach(), *grads)


def max_errors(got, ref) -> list[float]:
    return [(a - b).abs().max().item() for a, b in zip(got, ref)]


def test_per_sequence_reference_is_causal_attention_within_each_span():
    """The reference itself, against attention written out by hand for every sequence."""
    q, k, v, cu, _ = packed_inputs(torch.float64)
    out = pa.packed_causal_attention(q, k, v, cu, path="per_sequence")
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = q[a:b], k[a:b].repeat_interleave(2, 1), v[a:b].repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(DIM)
        scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
        assert (out[a:b] - expected).abs().max().item() < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flex_path_equals_per_sequence_attention(flex_backward_on_cpu, dtype):
    q, k, v, cu, grad_out = packed_inputs(dtype)
    ref = run("per_sequence", q, k, v, cu, grad_out)
    got = run("flex", q, k, v, cu, grad_out)
    errors = max_errors(got, ref)
    print(f"flex vs per-sequence, {dtype}: max |diff| out/dq/dk/dv = " + " / ".join(f"{e:.1e}" for e in errors))
    assert got[0].shape == (sum(REAL) + sum(PAD), HEADS, DIM) and got[2].shape == k.shape
    assert max(errors) < BOUND[dtype]


def test_a_mask_that_lets_sequences_see_each_other_is_caught(flex_backward_on_cpu, monkeypatch):
    """The comparison above is sensitive to the document term: causal over the whole row fails it."""
    def causal_only(doc):
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx

    q, k, v, cu, grad_out = packed_inputs(torch.float32)
    ref = run("per_sequence", q, k, v, cu, grad_out)
    monkeypatch.setattr(pa, "document_causal_mask_mod", causal_only)
    errors = max_errors(run("flex", q, k, v, cu, grad_out), ref)
    print(f"flex with the span term dropped: max |diff| out/dq/dk/dv = " + " / ".join(f"{e:.1e}" for e in errors))
    assert errors[0] > 1e-1
    # the first sequence sees nothing before it, so it alone still agrees
    assert (pa.packed_causal_attention(q, k, v, cu, path="flex")[:REAL[0]] - ref[0][:REAL[0]]).abs().max() < 1e-5


class VarlenStandIn:
    """torch 2.11's ``varlen_attn`` signature and contract, computed per sequence by hand (CPU has no
    FlashAttention kernel). Checks what the project passes: equal head counts (2.11 has no GQA),
    int32 offsets on the query's device, ``max_q`` the longest span, causal as ``window_size=(-1, 0)``."""

    def __init__(self):
        self.calls = 0

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)):
        self.calls += 1
        assert query.shape[1] == key.shape[1] == value.shape[1], "torch 2.11's varlen_attn has no GQA"
        assert cu_seq_q.dtype == torch.int32 and cu_seq_q.device == query.device and cu_seq_k is cu_seq_q
        assert window_size == (-1, 0) and return_aux is None and scale is not None
        spans = cu_seq_q.tolist()
        assert max_q == max_k == max(b - a for a, b in zip(spans, spans[1:]))
        out = []
        for a, b in zip(spans, spans[1:]):
            scores = torch.einsum("qhd,khd->hqk", query[a:b], key[a:b]) * scale
            scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), value[a:b]))
        return torch.cat(out)


@pytest.fixture
def varlen_stand_in(monkeypatch):
    from torch.nn.attention import varlen
    stand_in = VarlenStandIn()
    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    yield stand_in


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_varlen_path_plumbing_equals_per_sequence_attention(varlen_stand_in, dtype):
    assert pa.varlen_api() is not None and not pa.varlen_api().native_gqa  # 2.11's signature: heads expanded
    q, k, v, cu, grad_out = packed_inputs(dtype)
    ref = run("per_sequence", q, k, v, cu, grad_out)
    got = run("varlen", q, k, v, cu, grad_out)
    errors = max_errors(got, ref)
    print(f"varlen plumbing vs per-sequence, {dtype}: max |diff| out/dq/dk/dv = "
          + " / ".join(f"{e:.1e}" for e in errors))
    assert varlen_stand_in.calls == 1 and max(errors) < BOUND[dtype]


def test_varlen_with_native_gqa_passes_the_kv_heads_unexpanded(monkeypatch):
    """torch >= 2.12's varlen_attn takes enable_gqa: then the key/value heads go in as they are."""
    from torch.nn.attention import varlen
    seen = {}

    def stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False):
        seen.update(kv_heads=key.shape[1], enable_gqa=enable_gqa)
        return torch.zeros_like(query)

    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    q, k, v, cu, _ = packed_inputs(torch.float32)
    pa.packed_causal_attention(q, k, v, cu, path="varlen")
    assert seen == {"kv_heads": KV_HEADS, "enable_gqa": True}


def test_auto_picks_varlen_only_where_flash_attention_runs(varlen_stand_in):
    q = torch.zeros(8, HEADS, DIM)
    assert pa.resolve_path("auto", q) == "per_sequence"  # CPU
    assert "CUDA-only" in pa.varlen_unavailable("cpu", torch.bfloat16, 128)
    assert "fp16/bf16" in pa.varlen_unavailable("cuda", torch.float32, 128)
    assert "head dims" in pa.varlen_unavailable("cuda", torch.bfloat16, 320)
    assert "capability 8.0" in pa.varlen_unavailable("cuda", torch.bfloat16, 128, (7, 0))
    assert pa.varlen_unavailable("cuda", torch.bfloat16, 128) is None
    assert pa.varlen_unavailable("cuda", torch.bfloat16, 128, (9, 0)) is None
    assert pa.resolve_path("varlen", q) == "varlen" and pa.resolve_path("per_sequence", q) == "per_sequence"
    assert pa.resolve_path("auto", q, dropout_p=0.1) == "per_sequence"
    with pytest.raises(ValueError, match="no attention dropout"):
        pa.resolve_path("flex", q, dropout_p=0.1)
    with pytest.raises(ValueError, match="must be one of"):
        pa.resolve_path("fast", q)


def test_config_and_model_refuse_unknown_modes(layout):
    with pytest.raises(ConfigError, match="packed_attention must be one of"):
        TrainerConfig(packed_attention="fast").validate()
    TrainerConfig(packed_attention="flex").validate()
    model = build_model(REPO_ROOT / "assets" / "policy", pg_collection=layout.pg_collection)
    with pytest.raises(ValueError, match="must be one of"):
        set_packed_attention(model, "fast")


# -- the shipped policy's Megatron model, packed forward and backward ----------------------------------------

def packed_micro_batch():
    from rollpacker.sample import Prompt, Sample
    from rollpacker.trainer.backend_gpu import cp_shard
    from rollpacker.trainer.packing import build_micro_batch

    gen = torch.Generator().manual_seed(3)
    samples = [Sample(prompt=Prompt(uid=i, input_ids=torch.randint(0, 297, (p,), generator=gen).tolist(),
                                    data_source="synthetic"),
                      response_index=0, response_ids=torch.randint(0, 297, (r,), generator=gen).tolist(),
                      reward=1.0, advantage=1.0)
               for i, (p, r) in enumerate([(5, 9), (3, 1), (8, 30), (2, 6), (11, 4)])]
    thd = build_micro_batch(samples, aggregation="token_mean", layout="thd", pad_multiple=4)
    assert (thd.cu_seqlens != thd.cu_seqlens_unpadded).any()  # padded spans are exercised
    return cp_shard(thd, cp=1, cp_rank=0)


def forward_backward(model, shard, params, weights):
    model.zero_grad(set_to_none=True)
    pa._last_packing.clear()
    logits = model(shard.input_ids, shard.position_ids, attention_mask=None, packed_seq_params=params)
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("path", ["flex", "varlen"])
def test_shipped_policy_packed_step_equals_the_per_sequence_one(layout, flex_backward_on_cpu, varlen_stand_in, path):
    """Logits and every parameter gradient of a packed forward+backward of assets/policy (GQA, padded
    spans, RoPE restarting per sequence) through ``path``, against the per-sequence attention."""
    policy = REPO_ROOT / "assets" / "policy"
    model = build_model(policy, pg_collection=layout.pg_collection)
    load_hf_checkpoint(model, policy)
    shard, params = packed_micro_batch()
    assert params.cu_seqlens_q_padded is not None and params.cu_seqlens_q_padded.device.type == "cpu"
    weights = torch.randn(1, shard.input_ids.shape[1], model.vocab_size, generator=torch.Generator().manual_seed(4))

    assert set_packed_attention(model, "per_sequence") == model.config.num_layers
    ref_logits, ref_grads = forward_backward(model, shard, params, weights)
    assert packed_attention_paths(model) == {"per_sequence": model.config.num_layers}
    set_packed_attention(model, path)
    logits, grads = forward_backward(model, shard, params, weights)
    assert packed_attention_paths(model) == {path: model.config.num_layers}
    # every layer read the same host cu_seqlens: one device copy (or block mask) per micro-batch
    [packing] = pa._last_packing
    assert packing.cu_seqlens is params.cu_seqlens_q_padded and len(packing._on_device) == 1

    logit_err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    grad_err = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items())
    print(f"shipped policy, {path} vs per-sequence: logits {logit_err:.1e}, parameter grads {grad_err:.1e} "
          f"(max |diff| / max |ref|)")
    assert logit_err < 1e-5 and grad_err < 2e-5
    if path == "varlen":
        assert varlen_stand_in.calls == model.config.num_layers
