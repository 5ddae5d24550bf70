"""The parallelism planner's published rules."""
from __future__ import annotations

import json

import pytest

from rollpacker.configlib import ConfigError
from rollpacker.scheduler import ParallelismPlanner, RoundKind, TPProfile
from rollpacker.scheduler.config import PlannerConfig
from rollpacker.scheduler.round import EngineLayout
from testkit import REPO_ROOT

SHORT, LONG = RoundKind.SHORT, RoundKind.LONG


def planner(ranks=16, **cfg) -> ParallelismPlanner:
    p = ParallelismPlanner(PlannerConfig(**{"short_tp": 1, "long_tp": 2, **cfg}), ranks)
    p.layout_for(SHORT, requests=1280, max_response_tokens=16384).tp
    p.layout_for(LONG, requests=1024, max_response_tokens=16384).tp
    return p


def run(p: ParallelismPlanner, kind: RoundKind, preemptions: list[int]) -> list[int]:
    out = []
    for n in preemptions:
        p.observe(kind, n, 500.0)
        out.append(p.layout_for(kind, requests=1, max_response_tokens=1).tp)
    return out


def test_initial_tp_per_kind_from_config():
    p = planner()
    assert (p.layout_for(SHORT, requests=1, max_response_tokens=1).tp, p.layout_for(LONG, requests=1, max_response_tokens=1).tp) == (1, 2)


def test_rising_preemptions_double_tp_only_above_the_ratio():
    p = planner()
    # 100 -> 105 is exactly 1.05x: no change; 105 -> 111 is > 1.05x: double; 0 -> 3 is a rise
    assert run(p, SHORT, [100, 105, 111, 50, 0, 3]) == [1, 1, 2, 2, 2, 4]


def test_four_zero_rounds_halve_and_a_nonzero_round_resets_the_count():
    p = planner(long_tp=8)
    assert run(p, LONG, [0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0]) == [8, 8, 8, 8, 8, 8, 8, 4, 4, 4, 4, 2]
    assert run(p, LONG, [0] * 8) == [2, 2, 2, 1, 1, 1, 1, 1]  # never below 1


def test_tp_stays_within_the_node_and_divides_the_ranks():
    assert run(planner(ranks=16, max_tp=4), SHORT, [1, 2, 4, 8, 16]) == [1, 2, 4, 4, 4]
    assert run(planner(ranks=12, max_tp=8), SHORT, [1, 2, 4, 8, 16]) == [1, 2, 4, 4, 4]  # 8 does not divide 12
    with pytest.raises(ConfigError, match="long_tp=8 .* allowed: \\[1, 2, 4\\]"):
        ParallelismPlanner(PlannerConfig(long_tp=8), 12)


def test_round_kinds_adapt_independently():
    p = planner()
    run(p, SHORT, [10, 20])
    assert p.layout_for(SHORT, requests=1, max_response_tokens=1).tp == 2
    assert run(p, LONG, [10]) == [2]  # the short rounds' history does not count for long rounds


def test_disabled_planner_keeps_the_fixed_tp():
    p = ParallelismPlanner(PlannerConfig(enabled=False, short_tp=1, long_tp=2), 8, fixed_tp=4)
    assert p.layout_for(SHORT, requests=1, max_response_tokens=1).tp == 4
    p.observe(SHORT, 100, 1.0)
    p.observe(SHORT, 1000, 1.0)
    assert p.layout_for(SHORT, requests=1, max_response_tokens=1).tp == 4


def test_profile_picks_the_fastest_tp_that_fits_the_kv():
    profile = [TPProfile(1, decode_tokens_per_s=3000, kv_capacity_tokens=100_000),
               TPProfile(2, decode_tokens_per_s=5000, kv_capacity_tokens=400_000)]
    p = ParallelismPlanner(PlannerConfig(), 8, profile=profile)
    # 8 engines at TP1 -> 1.5 x 3000 x 8 = 36k tok/s; 4 at TP2 -> 20k tok/s: TP1 wins when KV fits
    assert p.layout_for(LONG, requests=800, max_response_tokens=4 * 500).tp == 1
    # 1600 requests x 2000 tokens: 400k per TP1 engine, 4x its KV (recompute) -> TP2 wins
    assert p.layout_for(SHORT, requests=1600, max_response_tokens=4 * 2000).tp == 2


def test_state_round_trips_through_json():
    p = planner()
    run(p, SHORT, [5, 50, 0])
    q = planner()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.state_dict() == p.state_dict()
    assert run(q, SHORT, [0, 0, 0, 0]) == run(p, SHORT, [0, 0, 0, 0])


def test_profile_rows_come_from_the_config_and_are_checked():
    from rollpacker.config import load_config
    cfg = load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml").scheduler.planner
    assert [row.tp for row in cfg.profile] == [1, 2]
    p = ParallelismPlanner(cfg, 2)
    # measured on 2 cores: one TP-2 engine is slower than the two TP-1 engines it replaces
    assert p.layout_for(SHORT, requests=100, max_response_tokens=512).tp == 1
    assert p.layout_for(LONG, requests=64, max_response_tokens=512).tp == 1
    with pytest.raises(ConfigError, match=r"layout \(tp, ep\) twice"):
        load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml",
                    ["scheduler.planner.profile=[{tp: 1, decode_tokens_per_s: 1, kv_capacity_tokens: 1}, "
                     "{tp: 1, decode_tokens_per_s: 2, kv_capacity_tokens: 1}]"])
    with pytest.raises(ConfigError, match=r"planner\.profile\[0\]\.tp must be a power of two"):
        load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml",
                    ["scheduler.planner.profile=[{tp: 3, decode_tokens_per_s: 1, kv_capacity_tokens: 1}]"])


def test_tp_choices_are_what_every_rank_builds():
    assert PlannerConfig(max_tp=8).tp_choices(16, 1) == [1, 2, 4, 8]
    assert PlannerConfig(max_tp=8).tp_choices(12, 1) == [1, 2, 4]
    assert PlannerConfig(enabled=False).tp_choices(16, 4) == [4]
    # the online rule never leaves the choices, so it never asks for an engine nobody built
    p = ParallelismPlanner(PlannerConfig(max_tp=4, short_tp=1, long_tp=2, grow_ratio=1.0), 8)
    p.layout_for(LONG, requests=8, max_response_tokens=8).tp
    for preemptions in (1, 2, 3, 4):
        p.observe(LONG, preemptions, 10.0)
        assert p.layout_for(LONG, requests=8, max_response_tokens=8).tp in PlannerConfig(max_tp=4).tp_choices(8, 1)


def test_each_kind_has_its_expert_parallel_size_capped_at_its_tp():
    p = planner(ranks=8, short_tp=2, short_ep=2, long_tp=4, long_ep=1)
    assert p.layout_for(SHORT, requests=1, max_response_tokens=1) == EngineLayout(2, 2)
    assert p.layout_for(LONG, requests=1, max_response_tokens=1) == EngineLayout(4, 1)
    for n in (1, 2):  # rising preemptions: TP 2 -> 4, the kind keeps EP 2
        p.observe(SHORT, n, 10.0)
    assert p.layout_for(SHORT, requests=1, max_response_tokens=1) == EngineLayout(4, 2)
    assert planner(short_ep=4).layout_for(SHORT, requests=1, max_response_tokens=1) == EngineLayout(1, 1)
    fixed = ParallelismPlanner(PlannerConfig(enabled=False, short_ep=2), 8, fixed_tp=4, fixed_ep=2)
    assert fixed.layout_for(LONG, requests=1, max_response_tokens=1) == EngineLayout(4, 2)


def test_every_layout_the_planner_may_pick_is_built():
    cfg = PlannerConfig(max_tp=4, short_ep=2, long_ep=1)
    choices = cfg.layout_choices(8, 1)
    assert [(c.tp, c.ep) for c in choices] == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]
    assert PlannerConfig(enabled=False, short_ep=2).layout_choices(8, 4, 2) == [EngineLayout(4, 2)]
    p = ParallelismPlanner(PlannerConfig(max_tp=4, short_tp=1, short_ep=2, long_tp=2, long_ep=2, grow_ratio=1.0), 8)
    seen = set()
    for kind in (SHORT, LONG):
        for n in (1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0):
            p.observe(kind, n, 10.0)
            seen.add(p.layout_for(kind, requests=8, max_response_tokens=8))
    assert seen <= set(PlannerConfig(max_tp=4, short_ep=2, long_ep=2).layout_choices(8, 1)), seen


def test_profile_picks_expert_parallel_for_short_rounds_and_expert_tp_for_long_ones():
    """Whole experts per rank decode the most tokens per second when many requests share the engine;
    one response alone decodes fastest with every expert sharded over all ranks. The model bounds a
    round by both, so the round kinds part ways."""
    rows = [TPProfile(1, decode_tokens_per_s=2500, kv_capacity_tokens=10**6, request_tokens_per_s=40),
            TPProfile(2, decode_tokens_per_s=4000, kv_capacity_tokens=10**6, request_tokens_per_s=80),
            TPProfile(2, decode_tokens_per_s=6000, kv_capacity_tokens=10**6, ep=2, request_tokens_per_s=50)]
    p = ParallelismPlanner(PlannerConfig(max_tp=2), 8, profile=rows)
    # 1600 x 500 tokens: TP1 40 s, TP2 50 s, TP2/EP2 33 s (throughput-bound)
    assert p.layout_for(SHORT, requests=1600, max_response_tokens=4 * 500) == EngineLayout(2, 2)
    # 64 x 2000 tokens: one response alone takes 50 s at TP1, 25 s at TP2, 40 s at TP2/EP2
    p.observe(SHORT, None, 2000.0)  # the responses seen so far average 2000 tokens
    assert p.layout_for(LONG, requests=64, max_response_tokens=8000) == EngineLayout(2, 1)
    assert rows[0].round_seconds(8, 64, 2000) == 50.0 and rows[2].round_seconds(4, 1600, 500) == pytest.approx(33.33, 1e-3)
    with pytest.raises(ConfigError, match="ep=4 must divide tp=2"):
        TPProfile(2, decode_tokens_per_s=1, kv_capacity_tokens=1, ep=4).validate()
