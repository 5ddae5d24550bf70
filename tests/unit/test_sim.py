"""The modeled engine, the trace reader and the simulator's command line (its ``main``; the module run as a
process: tests/integration/test_sim_procs.py)."""
from __future__ import annotations

import json
import statistics

import pytest

from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.sample import Prompt, Sample
from rollpacker.scheduler import VirtualClock
from rollpacker.sim import H800, QWEN25, ModelSpec, PerfModel, SimEngine, TraceError, load_trace, longtail_trace
from rollpacker.sim.__main__ import main
from rollpacker.sim.traces import parse_request_id

TINY = ModelSpec("tiny", 5e8, 8, 1024, 2)


def drain(engine: SimEngine, clock: VirtualClock) -> list:
    out = []
    while (t := engine.next_event_time()) is not None:
        clock.advance_to(max(t, clock.now()))
        out += engine.poll()
    return out


def test_single_request_time_matches_the_closed_form():
    clock, perf = VirtualClock(), PerfModel(QWEN25["14b"], H800, 2)
    engine = SimEngine(perf, clock, lambda req: 1000)
    engine.submit([GenerationRequest("p0e0r0", [0] * 200, SamplingParams(max_new_tokens=4096))])
    (c,) = drain(engine, clock)
    expected = perf.prefill_seconds(200) + sum(perf.decode_seconds(1, 1, 200 + j) for j in range(1000))
    assert c.finished_at == pytest.approx(expected, rel=1e-9)
    assert len(c.output_ids) == 1000 and c.finish_reason == "stop"
    # ~6.3 ms weight read + 1.5 ms overhead + 1.2 ms all-reduce per step for 14B at TP2
    assert 8e-3 < expected / 1000 < 1e-2


def test_length_limit_and_steps_within():
    perf = PerfModel(QWEN25["7b"], H800, 1)
    for budget in (0.01, 0.5, 7.0):
        k = perf.steps_within(budget, 64, 50_000)
        assert perf.decode_seconds(k, 64, 50_000) <= budget < perf.decode_seconds(k + 1, 64, 50_000)
    clock = VirtualClock()
    engine = SimEngine(perf, clock, lambda req: 9999)
    engine.submit([GenerationRequest("p0e0r0", [0] * 8, SamplingParams(max_new_tokens=300))])
    (c,) = drain(engine, clock)
    assert (len(c.output_ids), c.finish_reason) == (300, "length")


def test_kv_pressure_preempts_and_recomputes_without_losing_work():
    clock = VirtualClock()
    engine = SimEngine(PerfModel(TINY, H800, 1), clock, lambda req: 400 + 10 * int(req.request_id.rpartition("r")[2]),
                       kv_capacity_tokens=2000)
    params = SamplingParams(max_new_tokens=1024)
    engine.submit([GenerationRequest(f"p0e0r{i}", [0] * 50, params) for i in range(12)])
    done = drain(engine, clock)
    stats = engine.stats()
    assert sorted(len(c.output_ids) for c in done) == [400 + 10 * i for i in range(12)]
    assert stats.preemptions > 0 and stats.kv_tokens_used == 0
    assert stats.tokens_generated == sum(400 + 10 * i for i in range(12))  # recompute re-prefills, keeps tokens


def test_abort_frees_kv_and_never_completes():
    clock = VirtualClock()
    engine = SimEngine(PerfModel(TINY, H800, 1), clock, lambda req: 100)
    engine.submit([GenerationRequest(f"p0e0r{i}", [0] * 10, SamplingParams()) for i in range(4)])
    clock.advance_to(engine.next_event_time() / 2)
    engine.poll()
    engine.abort(["p0e0r1", "p0e0r2"])
    assert sorted(c.request_id for c in drain(engine, clock)) == ["p0e0r0", "p0e0r3"]
    assert engine.stats().kv_tokens_used == 0 and engine.active_request_ids() == []


def test_request_ids_parse_back():
    s = Sample(prompt=Prompt(uid=12, input_ids=[1], data_source="x", epoch=3), response_index=7)
    assert parse_request_id(s.request_id) == (12, 3, 7)
    with pytest.raises(ValueError):
        parse_request_id("req-1")


def test_longtail_model_matches_the_published_spread():
    ratios = []
    for seed in range(5):
        trace = longtail_trace(128, samples=8, median=585, limit=10**9, seed=seed)
        lengths = [n for p in trace for n in p.lengths]
        ratios.append(max(lengths) / statistics.median(lengths))
    assert 20 < statistics.median(ratios) < 40


@pytest.mark.parametrize("content, message", [
    ("", ":1: empty trace"),
    ('{"prompt_id": "a", "lengths": [3]}\n\n{"prompt_id": "b"}\n', ":3: missing field 'lengths'"),
    ('{"lengths": [3]}\n', ":1: missing field 'prompt_id'"),
    ('{"prompt_id": "a", "lengths": [3]}\n{"prompt_id": "b", "lengths": [5, -2]}\n', ":2: lengths[1] = -2"),
    ('{"prompt_id": "a", "lengths": []}\n', ":1: 'lengths' must be a non-empty list"),
    ('{"prompt_id": "a", "lengths": [3]}\n{"prompt_id": "a", "lengths": [3]\n', ":2: not valid JSON"),
    ('[1, 2]\n', ":1: expected a JSON object"),
])
def test_bad_trace_files_are_refused_with_the_line(tmp_path, content, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def test_cli_runs_a_trace_and_reports_json(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    rows = longtail_trace(64, samples=10, median=2048 / 28, limit=2048, seed=1)
    trace.write_text("".join(json.dumps({"prompt_id": p.prompt_id, "lengths": list(p.lengths)}) + "\n" for p in rows))
    assert main(["--trace", str(trace), "--json", "--gpus", "4", "--p0", "16", "--limit", "2048"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = [r["kind"] for r in report["tail_batching"]]
    assert kinds == ["short"] * 4 + ["long"] + ["short"] * 4 + ["long"]
    assert all(r["kind"] == "baseline" and r["wasted_tokens"] == 0 for r in report["baseline"])
    summary = report["summary"]
    assert summary["speedup"] == pytest.approx(summary["baseline_mean_s"] / summary["tail_mean_s"])
    assert summary["speedup"] > 1.2 and summary["tail_bubble"] < summary["baseline_bubble"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_id": 1, "lengths": [-4]}\n')
    assert main(["--trace", str(bad)]) == 2
    assert f"{bad}:1: lengths[0] = -4" in capsys.readouterr().err


def test_fitted_cost_recovers_the_affine_step_and_runs_the_modeled_engine():
    """bench.system.cpu_decode_bound's fit on exact affine timings gives back the coefficients, and the modeled
    engine's closed forms agree with step-by-step sums at that cost."""
    from bench.system.cpu_decode_bound import fit
    from rollpacker.sim.perf import FittedCost

    a, b, c = 2.4e-3, 6e-5, 7e-7
    rows = [{"batch": n, "prompt": x, "context": x + 12, "step_s": a + n * (b + c * (x + 12)), "prefill_s": 1e-5 * n * x}
            for n in (1, 4, 16, 64) for x in (32, 128, 384)]
    cost, fitted = fit(rows, 32768)
    print({k: f"{v:.3g}" for k, v in fitted.items()})
    assert (fitted["step_s"], fitted["per_request_s"], fitted["per_context_token_s"]) == pytest.approx((a, b, c), rel=1e-6)
    assert fitted["max_relative_error"] < 1e-6 and fitted["prefill_per_token_s"] == pytest.approx(1e-5)
    stepwise = sum(cost.decode_seconds(1, 8, 8 * 100 + 8 * j) for j in range(50))
    assert cost.decode_seconds(50, 8, 800) == pytest.approx(stepwise, rel=1e-12)
    k = cost.steps_within(0.05, 8, 800)
    assert cost.decode_seconds(k, 8, 800) <= 0.05 < cost.decode_seconds(k + 1, 8, 800)
    clock = VirtualClock()
    engine = SimEngine(FittedCost(a, b, c, 1e-5, 32768), clock, lambda req: 40)
    engine.submit([GenerationRequest(f"p0e0r{i}", [0] * 16, SamplingParams(max_new_tokens=64)) for i in range(4)])
    assert sorted(len(x.output_ids) for x in drain(engine, clock)) == [40] * 4
