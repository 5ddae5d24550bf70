"""Routing replay, the engine's side: the reference engine reports the experts its MoE router chose at every
position it fed through the model (``RolloutConfig.return_routing``, ``Completion.routed_experts``)."""
from __future__ import annotations

import pickle
from array import array
from pathlib import Path

import pytest
import torch

from rollpacker.hf_spec import parse_spec
from rollpacker.rollout import make_engine
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import FINISH_EVICTED, GenerationRequest, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from testkit import hf_router_topk, make_random_qwen3, make_random_qwen3_moe
from tests.unit.test_engine import _run

torch.set_num_threads(1)
PROMPT_LENGTHS = (3, 17, 8, 30, 1, 12)
MAX_NEW = 20


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """8 experts, top-2, layers 0 and 2 sparse, the middle one dense (testkit's defaults)."""
    return make_random_qwen3_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", seed=2)


def _engine(model_dir: Path, engine_id: int = 0, **cfg) -> ReferenceEngine:
    return make_engine(RolloutConfig(**{"kv_page_size": 4, "return_routing": True, "seed": 1, **cfg}), model_dir,
                       engine_id=engine_id)


def _requests(seed: int = 0) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    return [GenerationRequest(f"r{i}", torch.randint(0, 250, (n,), generator=g).tolist(),
                              SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=100 + i))
            for i, n in enumerate(PROMPT_LENGTHS)]


def _hf_routing(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' top-k choices on ``ids``: [positions, sparse layers, k] (``testkit.hf_router_topk``)."""
    from transformers import AutoModelForCausalLM
    hf = _hf_routing.cache.get(model_dir)
    if hf is None:
        hf = _hf_routing.cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = parse_spec(model_dir)
    return hf_router_topk(hf, ids, spec.moe_layers, spec.experts_per_token)


_hf_routing.cache = {}


def _routing(c, spec) -> torch.Tensor:
    return torch.tensor(list(c.routed_experts)).view(-1, len(spec.moe_layers), spec.experts_per_token)


def _check_against_transformers(model_dir: Path, requests, got) -> tuple[int, int]:
    """(entries equal to transformers', entries) over every request; asserts the layout's length."""
    spec = parse_spec(model_dir)
    equal = total = 0
    for r in requests:
        c = got[r.request_id]
        fed = len(r.input_ids) + len(c.output_ids) - 1
        assert len(c.routed_experts) == fed * len(spec.moe_layers) * spec.experts_per_token, r.request_id
        ref = _hf_routing(model_dir, list(r.input_ids) + list(c.output_ids))[:fed]
        mine = _routing(c, spec)
        equal += int((mine == ref).sum())
        total += ref.numel()
    return equal, total


def test_routing_equals_transformers_top_k(moe_dir):
    requests = _requests(0)
    got = _run(_engine(moe_dir), requests)
    assert all(isinstance(c.routed_experts, array) and c.routed_experts.typecode == "i" for c in got.values())
    equal, total = _check_against_transformers(moe_dir, requests, got)
    print(f"qwen3_moe routing: {equal}/{total} top-k entries equal to transformers' router")
    assert equal == total


def test_preempted_requests_keep_their_routing(moe_dir):
    """A KV budget that forces preemption: recomputed positions are not recorded twice, and the routing is
    still transformers' (and the unpreempted engine's)."""
    requests = _requests(1)
    tight = _engine(moe_dir, kv_cache_tokens=96, max_prefill_tokens=64)
    got = _run(tight, requests)
    assert tight.stats().preemptions > 0
    roomy = _run(_engine(moe_dir), requests)
    assert {k: list(c.output_ids) for k, c in got.items()} == {k: list(c.output_ids) for k, c in roomy.items()}
    same = sum(list(got[k].routed_experts) == list(roomy[k].routed_experts) for k in got)
    equal, total = _check_against_transformers(moe_dir, requests, got)
    print(f"qwen3_moe routing with {tight.stats().preemptions} preemptions: {same}/{len(got)} requests routed as "
          f"without; {equal}/{total} entries equal to transformers'")
    assert same == len(got) and equal == total


def test_migrated_request_reports_the_routing_of_an_unmoved_one(moe_dir):
    requests = _requests(2)
    expected = _run(_engine(moe_dir), requests)

    source, target = _engine(moe_dir, 1), _engine(moe_dir, 2)
    source.submit(requests)
    finished = {}
    for _ in range(6):
        finished.update((c.request_id, c) for c in source.poll(0.0))
    handed = source.evict([r.request_id for r in requests])
    partial = [c for c in handed if c.finish_reason == FINISH_EVICTED]
    assert partial and any(c.output_ids for c in partial)
    by_id = {r.request_id: r for r in requests}
    spec = parse_spec(moe_dir)
    width = len(spec.moe_layers) * spec.experts_per_token
    for c in partial:  # the positions fed so far on the source, as the unmoved engine routed them
        fed = len(by_id[c.request_id].input_ids) + len(c.output_ids) - 1
        assert list(c.routed_experts) == list(expected[c.request_id].routed_experts)[:fed * width]
    finished.update((c.request_id, c) for c in handed if c.finish_reason != FINISH_EVICTED)
    target.submit([by_id[c.request_id].resumed_from(c) for c in partial])
    finished.update(_run(target, []))

    assert finished.keys() == expected.keys()
    same = sum(list(finished[k].routed_experts) == list(c.routed_experts) for k, c in expected.items())
    print(f"qwen3_moe routing after migration: {same}/{len(expected)} requests routed as the unmoved ones "
          f"({len(partial)} moved)")
    for rid, c in expected.items():
        assert list(finished[rid].output_ids) == list(c.output_ids), rid
    assert same == len(expected)


def test_routing_survives_pickling_packed(moe_dir):
    c = _run(_engine(moe_dir), _requests(3)[:1])["r0"]
    back = pickle.loads(pickle.dumps(c, pickle.HIGHEST_PROTOCOL))
    assert isinstance(back.routed_experts, array) and back.routed_experts.typecode == "i"
    assert back.routed_experts == c.routed_experts and len(back.routed_experts) > 0


def test_no_routing_when_off_or_dense(moe_dir, tmp_path):
    requests = _requests(4)[:2]
    off = _run(_engine(moe_dir, return_routing=False), requests)
    assert all(len(c.routed_experts) == 0 for c in off.values())
    dense = _run(_engine(make_random_qwen3(tmp_path / "qwen3", seed=1)), requests)  # return_routing on
    assert all(len(c.routed_experts) == 0 for c in dense.values())
    back = pickle.loads(pickle.dumps(next(iter(off.values()))))
    assert len(back.routed_experts) == 0
