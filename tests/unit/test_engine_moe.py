"""Reference rollout engine on Qwen3-MoE: greedy and log-probs against transformers (fp32), weight updates."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollpacker.hf_spec import parse_spec
from rollpacker.rollout import make_engine
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.qwen_torch import iter_safetensors
from rollpacker.rollout.reference import ReferenceEngine
from testkit import make_random_qwen3_moe
from tests.unit.test_engine import _run

torch.set_num_threads(1)
PROMPT_LENGTHS = (3, 17, 8, 30, 1, 12)
MAX_NEW = 16
# 10x the measured max |delta| of 4.8e-7 (one float32 ulp of a log-prob in [-8, -4]), as for the dense models
LOGPROB_BOUND = 5e-6


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """8 experts, top-2 renormalised, 3 layers of which the middle one dense (testkit's defaults)."""
    return make_random_qwen3_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", seed=2)


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    return hf


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _greedy(engine, prompts) -> dict[str, list[int]]:
    got = _run(engine, [GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
                        for i, p in enumerate(prompts)])
    return {k: c.output_ids for k, c in got.items()}


def _hf_greedy(hf, prompts) -> dict[str, list[int]]:
    """One transformers call per prompt (no padding on the reference side), no EOS stop."""
    return {f"r{i}": hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist() for i, p in enumerate(prompts)}


def _engine(model_dir: Path) -> ReferenceEngine:
    return make_engine(RolloutConfig(kv_page_size=4), model_dir)


def test_spec_and_layout_of_the_random_moe(moe_dir):
    spec = parse_spec(moe_dir)
    assert spec.is_moe and spec.moe_layers == (0, 2) and spec.experts_per_token == 2 and spec.norm_topk_prob
    engine = _engine(moe_dir)
    assert set(engine.model.hf_names()) == set(spec.hf_shapes())
    assert engine.max_weight_diff(iter_safetensors(moe_dir)) == 0.0
    with pytest.raises(KeyError, match="model.layers.0.mlp.gate_proj.weight"):  # layer 0 is sparse
        engine.update_weights([("model.layers.0.mlp.gate_proj.weight", torch.zeros(160, 64))])


def test_greedy_matches_transformers(moe_dir):
    prompts = _prompts(0)
    got, ref = _greedy(_engine(moe_dir), prompts), _hf_greedy(_hf(moe_dir), prompts)
    equal = sum(a == b for k in ref for a, b in zip(got[k], ref[k]))
    print(f"qwen3_moe greedy: {equal}/{sum(map(len, ref.values()))} tokens equal to transformers")
    assert got == ref


def test_logprobs_match_transformers_forward(moe_dir):
    hf, prompts = _hf(moe_dir), _prompts(1)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=20, seed=7)
    got = _run(_engine(moe_dir), [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    worst = 0.0
    for i, p in enumerate(prompts):
        c = got[f"r{i}"]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([p + c.output_ids])).logits[0].float(), dim=-1)
        ref = logp[len(p) - 1:-1].gather(1, torch.tensor(c.output_ids).unsqueeze(1)).squeeze(1)
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    print(f"qwen3_moe: rollout vs transformers log-prob max |delta| = {worst:.2e} (bound {LOGPROB_BOUND:.0e})")
    assert worst < LOGPROB_BOUND


def test_update_weights_in_small_buckets_matches_transformers(moe_dir, tmp_path):
    """Perturbed tensors (router and experts included) pushed 5 at a time, so that buckets split experts'
    gate/up/down triples; the engine then generates what transformers loaded with the same tensors does."""
    g = torch.Generator().manual_seed(11)
    new = {name: t + 0.1 * t.abs().mean() * torch.randn(t.shape, generator=g)
           for name, t in iter_safetensors(moe_dir)}
    assert any(".mlp.gate.weight" in n for n in new) and any(".mlp.experts." in n for n in new)
    new_dir = tmp_path / "perturbed"
    new_dir.mkdir()
    shutil.copy(moe_dir / "config.json", new_dir / "config.json")
    save_file(new, str(new_dir / "model.safetensors"), metadata={"format": "pt"})

    prompts = _prompts(2)
    engine = _engine(moe_dir)
    before = _greedy(engine, prompts)
    items = list(new.items())
    for start in range(0, len(items), 5):
        engine.update_weights(iter(items[start:start + 5]))
    assert engine.max_weight_diff(iter(items)) == 0.0
    after = _greedy(engine, prompts)
    ref = _hf_greedy(_hf(new_dir), prompts)
    changed = sum(after[k] != before[k] for k in before)
    print(f"qwen3_moe after update_weights: {changed}/{len(before)} responses changed; equal to transformers: "
          f"{after == ref}")
    assert after == ref
    assert after != before
