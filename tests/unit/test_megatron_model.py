"""The Megatron Qwen2/Qwen3 model on CPU at TP=1: parity with transformers, log-probs, config refusals.

TP=2 and PP=2 run under torchrun in tests/integration/test_convert_procs.py.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_ext import weights
from megatron_ext.conversion import verify
from megatron_ext.parallel import setup_layout, teardown_layout
from megatron_ext.model import build_model, padded_vocab_size, transformer_config
from rollpacker.hf_spec import parse_spec
from tests.dist.megatron_convert_checks import logprob_grad_errors
from tests.dist.megatron_fixtures import ckpts, layout  # noqa: F401  (pytest fixtures)


# fp32 parity with transformers: 10x the measured max differences (README: |dlogp| 4.8e-7, one float32
# ulp of a log-prob in [-8, -4]; |dH| 1.4e-6), so a few ulps more from another CPU's summation order
# (its vector width picks how matmuls and log-softmax accumulate) pass and a real mismatch does not.
PARITY_LOGPROB_TOL, PARITY_ENTROPY_TOL = 5e-6, 1.5e-5


@pytest.mark.parametrize("kind", ["tied", "untied", "qwen3", "qwen3_tied"])
def test_logprob_parity_with_transformers(ckpts, layout, kind):
    spec = parse_spec(ckpts[kind])
    # The cases this parity is about: GQA, a vocabulary that needs padding, both embedding modes.
    assert spec.num_kv_heads < spec.num_heads and padded_vocab_size(spec, 1) > spec.vocab_size
    assert spec.tie_word_embeddings == (kind in ("tied", "qwen3_tied"))
    parity = verify(ckpts[kind], layout)
    print(f"TP=1 {kind}: max |dlogp| = {parity.logprob_diff:.3e}, max |dH| = {parity.entropy_diff:.3e}")
    assert parity.logprob_diff < PARITY_LOGPROB_TOL and parity.entropy_diff < PARITY_ENTROPY_TOL


def test_qwen3_model_has_per_head_qk_norms_and_no_qkv_bias(ckpts, layout):
    spec = parse_spec(ckpts["qwen3"])
    assert (spec.qk_norm, spec.qkv_bias, spec.head_dim) == (True, False, 32) and spec.head_dim * 4 != spec.hidden_size
    attention = build_model(ckpts["qwen3"], pg_collection=layout.pg_collection).decoder.layers[0].self_attention
    params = dict(attention.named_parameters())
    assert params["q_layernorm.weight"].shape == params["k_layernorm.weight"].shape == (32,)
    assert params["linear_qkv.weight"].shape == ((4 + 2 * 2) * 32, 64) and "linear_qkv.bias" not in params


def test_qwen3_head_dim_defaults_as_transformers_does(ckpts):
    from transformers import Qwen3Config

    cfg = json.loads((ckpts["qwen3"] / "config.json").read_text())
    del cfg["head_dim"]
    assert parse_spec(cfg).head_dim == Qwen3Config(**cfg).head_dim == 128  # not hidden 64 / 4 heads


def test_parity_check_catches_swapped_qk_norms(ckpts, layout, monkeypatch):
    real_bindings = weights._bindings
    other = {"q_norm.weight": "k_norm.weight", "k_norm.weight": "q_norm.weight"}
    cut = len("q_norm.weight")

    def swapped(model):
        return [dataclasses.replace(b, hf_names=(b.hf_names[0][:-cut] + other[b.hf_names[0][-cut:]],))
                if b.hf_names[0][-cut:] in other else b for b in real_bindings(model)]

    monkeypatch.setattr(weights, "_bindings", swapped)
    assert verify(ckpts["qwen3"], layout).logprob_diff > 1e-3


def test_parity_check_catches_a_wrong_qkv_layout(ckpts, layout, monkeypatch):
    real_shard = weights._shard

    def k_and_v_swapped(b, src, *args):
        return real_shard(b, [src[0], src[2], src[1]] if b.kind is weights._Kind.QKV else src, *args)

    monkeypatch.setattr(weights, "_shard", k_and_v_swapped)
    assert verify(ckpts["untied"], layout).logprob_diff > 1e-2


def test_bf16_parity_with_transformers_bf16(ckpts, layout):
    parity = verify(ckpts["untied"], layout, params_dtype=torch.bfloat16)
    print(f"TP=1 bf16: max |dlogp| = {parity.logprob_diff:.3e}")
    assert parity.logprob_diff < 2e-2  # 10x the 2.0e-3 measured: bf16 rounds both sides at 8 mantissa bits


def test_tied_model_has_no_separate_output_weight(ckpts, layout):
    tied = build_model(ckpts["tied"], pg_collection=layout.pg_collection)
    untied = build_model(ckpts["untied"], pg_collection=layout.pg_collection)
    assert tied.output_layer.weight is None and untied.output_layer.weight is not None
    assert tied.embedding.word_embeddings.weight.shape == (256, 64)  # 250 padded to a multiple of 128


@pytest.mark.parametrize("vocab", [250, 256])
@pytest.mark.parametrize("chunk", [2048, 4])
def test_logprobs_and_entropy_mask_padding_and_match_log_softmax(layout, chunk, vocab, monkeypatch):
    """Values and gradients against log_softmax over the real vocabulary, in one chunk and across
    chunk boundaries (21 tokens in chunks of 4), with padding columns and without (a vocabulary
    that is already a multiple of 128 skips the masking)."""
    from megatron_ext import logprobs
    monkeypatch.setattr(logprobs, "CHUNK_TOKENS", chunk)
    errors = logprob_grad_errors(layout, vocab=vocab)
    print(f"vocab {vocab}, chunk {chunk}: max errors {errors}")
    assert all(errors[name] < bound for name, bound in LOGPROB_GRAD_TOL.items())


# 10x the measured max errors against log_softmax (4.8e-7, 9.5e-7, 7.5e-8), here and at TP=2 (test_convert_procs.py).
LOGPROB_GRAD_TOL = {"logprob_value": 5e-6, "entropy_value": 1e-5, "grad": 1e-6}


def test_model_init_is_reproducible_from_the_layout_seed(ckpts):
    def first_weights(seed: int) -> torch.Tensor:
        layout = setup_layout(seed=seed)
        try:
            model = build_model(ckpts["untied"], pg_collection=layout.pg_collection)
            return model.decoder.layers[0].self_attention.linear_qkv.weight.detach().clone()
        finally:
            teardown_layout(layout)

    assert torch.equal(first_weights(7), first_weights(7))
    assert not torch.equal(first_weights(7), first_weights(8))


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, r"model_type='llama' is not supported; supported: 'qwen2' \(Qwen2/Qwen2.5\), "
                              r"'qwen3' \(Qwen3 dense\)"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true is not supported for Qwen3 dense"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope type 'yarn'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
])
def test_unsupported_hf_configs_are_refused(ckpts, change, message):
    cfg = json.loads((ckpts["untied"] / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        parse_spec({**cfg, **change})


@pytest.mark.parametrize("sizes, message", [
    (dict(tp=3), "num_attention_heads=4 is not divisible by tensor-parallel size 3"),
    (dict(tp=4), "num_key_value_heads=2 is not divisible by tensor-parallel size 4"),
    (dict(pp=3), "num_hidden_layers=2 is not divisible by pipeline-parallel size 3"),
])
def test_impossible_layouts_are_refused(ckpts, sizes, message):
    with pytest.raises(ValueError, match=message):
        transformer_config(parse_spec(ckpts["untied"]), **sizes)


def test_published_qwen25_config_keys_are_understood(ckpts):
    # transformers 4.x configs (the published Qwen2.5 checkpoints) carry rope_theta at the top level.
    cfg = json.loads((ckpts["untied"] / "config.json").read_text())
    del cfg["rope_parameters"]
    spec = parse_spec({**cfg, "rope_theta": 1e6, "rope_scaling": None})
    assert spec.rope_theta == 1e6 and spec.head_dim == 16


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_core_attention_matches_megatron_dot_product_attention(ckpts, layout, masked):
    """The CPU layer's fused attention equals Megatron's unfused one, values and gradients (GQA, causal)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.sdpa_attention import SDPADotProductAttention

    model = build_model(ckpts["untied"], pg_collection=layout.pg_collection)
    assert isinstance(model.decoder.layers[0].self_attention.core_attention, SDPADotProductAttention)
    config = model.config
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    seq, batch = 37, 3
    torch.manual_seed(0)
    q = torch.randn(seq, batch, heads, dim, requires_grad=True)
    k = torch.randn(seq, batch, groups, dim, requires_grad=True)
    v = torch.randn(seq, batch, groups, dim, requires_grad=True)
    mask = None
    if masked:  # Megatron's convention: True hides a key; here causal plus a few hidden keys per row
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1).expand(batch, 1, seq, seq).clone()
        mask[1, :, :, 5:9] = True
        mask[:, :, :, 0] = False
    outputs = []
    for cls in (DotProductAttention, SDPADotProductAttention):
        attn = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                   pg_collection=layout.pg_collection)
        out = attn(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
        out.square().sum().backward()
        outputs.append((out.detach(), *(t.grad.clone() for t in (q, k, v))))
        for t in (q, k, v):
            t.grad = None
    worst = 0.0
    for ref, got in zip(*outputs):
        assert ref.shape == got.shape
        worst = max(worst, (ref - got).abs().max().item())
    print(f"SDPA vs Megatron attention, output and q/k/v gradients: max |delta| = {worst:.2e}")
    assert worst < 1e-5  # 2.6x the 3.8e-6 measured: the gradients of a squared output reach |x| ~ 100


def test_megatron_attention_switches_every_layer_back_and_the_model_output_agrees(ckpts, layout):
    from megatron_ext.sdpa_attention import SDPADotProductAttention, megatron_attention

    model = build_model(ckpts["untied"], pg_collection=layout.pg_collection)
    ids = torch.randint(0, 250, (2, 29))
    positions = torch.arange(29).expand(2, -1)
    fused = model(ids, positions, attention_mask=None)
    with megatron_attention(model) as switched:
        assert switched == model.config.num_layers
        reference = model(ids, positions, attention_mask=None)
    assert all(type(layer.self_attention.core_attention) is SDPADotProductAttention for layer in model.decoder.layers)
    worst = (fused - reference).abs().max().item()
    print(f"model output, SDPA vs Megatron attention: max |delta| = {worst:.2e}")
    assert worst < 1.5e-6  # 10x the 1.5e-7 measured


def test_packed_thd_forward_equals_each_sequence_alone(ckpts, layout):
    """The GPU backend always feeds packed (THD) micro-batches; without Transformer Engine they run through
    the local spec's SDPA attention, which must keep sequences apart and restart positions per sequence."""
    from rollpacker.sample import Prompt, Sample
    from rollpacker.trainer.backend_gpu import cp_shard
    from rollpacker.trainer.packing import build_micro_batch

    model = build_model(ckpts["untied"], pg_collection=layout.pg_collection)
    gen = torch.Generator().manual_seed(3)
    samples = [Sample(prompt=Prompt(uid=i, input_ids=torch.randint(0, 250, (p,), generator=gen).tolist(),
                                    data_source="synthetic"),
                      response_index=0, response_ids=torch.randint(0, 250, (r,), generator=gen).tolist(),
                      reward=1.0, advantage=1.0)
               for i, (p, r) in enumerate([(5, 9), (3, 1), (8, 14), (2, 6)])]
    thd = build_micro_batch(samples, aggregation="token_mean", layout="thd", pad_multiple=4)
    assert (thd.cu_seqlens != thd.cu_seqlens_unpadded).any()  # padding between sequences is exercised
    shard, params = cp_shard(thd, cp=1, cp_rank=0)
    packed = model(shard.input_ids, shard.position_ids, attention_mask=None, packed_seq_params=params)[0]
    starts, lengths = thd.cu_seqlens[:-1].tolist(), thd.cu_seqlens_unpadded.diff().tolist()
    # Backward too: a loss over the real tokens gives the gradients of the sequences run alone.
    weights = torch.randn(packed.shape, generator=gen)
    (sum((packed[a:a + n] * weights[a:a + n]).sum() for a, n in zip(starts, lengths))).backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    worst = 0.0
    for s, start, n in zip(samples, starts, lengths):
        ids = torch.tensor([s.prompt.input_ids + s.response_ids])
        alone = model(ids, torch.arange(n)[None], attention_mask=None)[0]
        worst = max(worst, (packed[start:start + n] - alone).abs().max().item())
        (alone * weights[start:start + n]).sum().backward()
    worst_grad = max((packed_grads[name] - p.grad).abs().max().item() / (1 + p.grad.abs().max().item())
                     for name, p in model.named_parameters())
    print(f"packed vs alone: output max |delta| = {worst:.2e}, gradients max |delta| / (1 + max |g|) = {worst_grad:.2e}")
    assert worst < 2e-6 and worst_grad < 3e-6  # 10x the 1.8e-7 and 3.3e-7 measured
