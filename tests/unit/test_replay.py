"""Length replay (``rollpacker.rollout.replay``) on the real reference engine: every response exactly
as long as the trace says, through the real scheduler, and the config's refusals."""
from __future__ import annotations

import concurrent.futures
import json
import zlib

import pytest
import torch

from rollpacker.configlib import ConfigError
from rollpacker.rollout import make_engine
from rollpacker.rollout.config import ReplayConfig, RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.replay import LengthReplay, ReplayLengths
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource, LocalFleet, RealClock, RoundKind, Scheduler
from rollpacker.scheduler.config import PlannerConfig, SchedulerConfig
from rollpacker.sim.reward import SimScore
from testkit import make_random_qwen2

STOPS = tuple(range(0, 250, 9))  # ~11% stop chance per token: without replay, responses end early


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_qwen2(tmp_path_factory.mktemp("qwen2"), seed=3)


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text("".join(json.dumps({"prompt_id": f"q{i}", "lengths": [3 + i, 20 + i, 9]}) + "\n"
                            for i in range(4)))
    return path


def test_replayed_lengths_on_the_reference_engine(model_dir, trace):
    torch.set_num_threads(1)
    rollout = RolloutConfig(max_response_length=64, kv_cache_tokens=4096,
                            length_replay=ReplayConfig(enabled=True, trace=str(trace)))
    engine = make_engine(rollout, model_dir)
    assert isinstance(engine, LengthReplay)
    lengths = ReplayLengths(rollout.length_replay, rollout.max_response_length)
    requests = [GenerationRequest(f"p{uid}e0r{r}", [5, 6, 7], SamplingParams(max_new_tokens=64, stop_token_ids=STOPS,
                                                                            seed=100 * uid + r))
                for uid in range(6) for r in range(3)]
    requests.append(GenerationRequest("p1e0r9", [5, 6], SamplingParams(max_new_tokens=2, stop_token_ids=STOPS, seed=1)))
    engine.submit(requests)
    done = {}
    while engine.active_request_ids():
        done.update((c.request_id, c) for c in engine.poll(None))
    got = {rid: len(c.output_ids) for rid, c in done.items()}
    want = {r.request_id: min(r.params.max_new_tokens, lengths(r)) for r in requests}
    print(got)
    assert got == want and got["p1e0r9"] == 2  # the request's own limit caps the trace
    for rid, n in got.items():  # uid u reads row u mod 4 of the trace
        if rid != "p1e0r9":
            uid = int(rid[1])
            assert n in (3 + uid % 4, 20 + uid % 4, 9)
    assert len(set(got.values())) > 3
    # fixed by the request's id and seed: a migrated request keeps its length, a new seed draws again
    again = requests[0]
    assert lengths(again) == want[again.request_id]
    draws = {lengths(GenerationRequest("p0e0r0", [1], SamplingParams(seed=s))) for s in range(40)}
    assert draws == {3, 20, 9}
    engine.shutdown()


def test_scheduler_over_replayed_engines_keeps_every_length(model_dir):
    """The parametric model through the real scheduler: a tail batching cycle on two replayed engines,
    every trained response as long as its replayed length."""
    torch.set_num_threads(1)
    replay = ReplayConfig(enabled=True, median=8, sigma_prompt=0.8, sigma_response=0.65, seed=2)
    rollout = RolloutConfig(max_response_length=48, kv_cache_tokens=4096, length_replay=replay)
    engines = [make_engine(rollout, model_dir, engine_id=i) for i in range(2)]
    lengths = ReplayLengths(replay, rollout.max_response_length)
    prompts = [Prompt(uid=i, input_ids=[(7 * i + j) % 250 for j in range(5 + i % 4)], data_source="t")
               for i in range(12)]
    scheduler = Scheduler(SchedulerConfig(p0=4, r0=2, planner=PlannerConfig(enabled=False)), rollout,
                          ListPromptSource(prompts), rollout_ranks=2, stop_token_ids=list(STOPS))
    seen = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sink = type("Sink", (), {"submit": lambda self, s, key=None, adapt=True: pool.submit(lambda: SimScore(1.0, True))})()
        for expected in [RoundKind.SHORT] * 4 + [RoundKind.LONG]:
            plan = scheduler.plan_round()
            result = scheduler.run_round(plan, LocalFleet(engines, RealClock(), sink))
            assert plan.kind is expected and len(result.groups) == 4
            for s in result.samples:
                request = GenerationRequest(s.request_id, [], SamplingParams(seed=_seed_of(result, s)))
                seen.append((s.num_response_tokens, lengths(request)))
    print(seen)
    assert seen and all(n == want for n, want in seen)
    assert max(n for n, _ in seen) > 3 * sorted(n for n, _ in seen)[len(seen) // 2]  # a long tail


def _seed_of(result, sample) -> int:
    """The sampling seed the scheduler gave ``sample``'s request (``GroupLaunch.seed``: the run's seed,
    the round and the request id)."""
    return zlib.crc32(f"0:{result.index}:{sample.request_id}".encode())


def test_replay_config_refuses_a_missing_trace_and_bad_parameters(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        RolloutConfig(length_replay=ReplayConfig(enabled=True, trace=str(tmp_path / "none.jsonl"))).validate()
    with pytest.raises(ConfigError, match="median >= 1"):
        RolloutConfig(length_replay=ReplayConfig(enabled=True, median=0)).validate()
