"""Migration by recompute: a request evicted from one engine continues on another as if it never moved."""
from __future__ import annotations

import pytest
import torch

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import FINISH_EVICTED, GenerationRequest, RequestError, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from testkit import REPO_ROOT

torch.set_num_threads(1)
POLICY = REPO_ROOT / "assets" / "policy"


def _engine(engine_id: int) -> ReferenceEngine:
    return ReferenceEngine(POLICY, RolloutConfig(kv_cache_tokens=4096, seed=1), engine_id=engine_id)


def _requests(n: int = 6, max_new: int = 48) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(3)
    return [GenerationRequest(f"q{i}", torch.randint(3, 200, (5 + 3 * i,), generator=g).tolist(),
                              SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=100 + i))
            for i in range(n)]


def _drain(engine: ReferenceEngine) -> dict:
    out = {}
    while engine.active_request_ids():
        out.update((c.request_id, c) for c in engine.poll(None))
    return out


def test_evicted_requests_continue_elsewhere_with_the_same_tokens():
    requests = _requests()
    stay = _engine(0)
    stay.submit(requests)
    expected = _drain(stay)

    source, target = _engine(1), _engine(2)
    source.submit(requests)
    finished = {}
    for _ in range(10):  # some tokens in, some requests perhaps already done
        finished.update((c.request_id, c) for c in source.poll(0.0))
    handed = source.evict([r.request_id for r in requests])
    assert source.active_request_ids() == [] and source.stats().kv_tokens_used == 0
    partial = [c for c in handed if c.finish_reason == FINISH_EVICTED]
    assert partial and any(c.output_ids for c in partial)
    finished.update((c.request_id, c) for c in handed if c.finish_reason != FINISH_EVICTED)
    by_id = {r.request_id: r for r in requests}
    target.submit([by_id[c.request_id].resumed_from(c) for c in partial])
    finished.update(_drain(target))

    assert finished.keys() == expected.keys()
    worst = max(abs(a - b) for rid, c in expected.items() for a, b in zip(finished[rid].logprobs, c.logprobs))
    print(f"migrated vs unmigrated log-prob max |delta| = {worst:.2e}")
    assert worst < 2e-5  # 10x the 2.2e-6 measured: the target rebuilds the moved tokens' KV in one prefill
    for rid, c in expected.items():
        assert finished[rid].output_ids == c.output_ids, rid
        assert finished[rid].finish_reason == c.finish_reason


def test_resume_is_checked():
    r = _requests(1, max_new=8)[0]
    engine = _engine(0)
    with pytest.raises(RequestError, match="resumes 8 tokens"):
        engine.submit([GenerationRequest(r.request_id, r.input_ids, r.params, tuple(range(8)), (0.0,) * 8)])
    with pytest.raises(RequestError, match="resumes 2 tokens with 1 log-probs"):
        engine.submit([GenerationRequest(r.request_id, r.input_ids, r.params, (5, 6), (0.0,))])
