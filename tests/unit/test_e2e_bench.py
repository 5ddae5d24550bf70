"""The pure logic of bench/e2e/ablation.py on synthetic metrics records (no torchrun)."""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from bench.e2e import stats as rep


def rec(step: int, kind: str, step_s: float, *, prompts: int = 16, reward: float = 0.5, ckpt: float = 0.0,
        wasted: int = 0, stream_groups: int = 0) -> dict:
    r = {"step": step, "round": kind, "prompts_kept": prompts, "time/step_s": step_s + ckpt,
         "time/rollout_s": step_s / 2, "time/train_s": step_s / 2, "bubble_fraction": 0.5,
         "generated_tokens": 1000, "wasted_tokens": wasted, "reward_mean": reward, "accuracy": reward,
         "train/stream_groups_before_rollout_end": stream_groups}
    if ckpt:
        r["time/checkpoint_s"] = ckpt
    return r


def tail_run(short_s: float, long_s: float, cycles: int = 2, **kw) -> list[dict]:
    out = []
    for c in range(cycles):
        for i in range(5):
            step = 5 * c + i + 1
            out.append(rec(step, "long" if i == 4 else "short", long_s if i == 4 else short_s, **kw))
    return out


def _fields(path: str, cls: str) -> set[str]:
    """A config dataclass's field names, read from its source (importing rollpacker.config pulls in torch)."""
    tree = ast.parse(Path(path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}


def test_modes_are_cumulative_and_use_real_config_keys():
    assert [m.key for m in rep.MODES] == ["baseline", "tail_batching", "async_reward", "planner", "stream"]
    assert rep.MODES[0].overrides["scheduler.mode"] == "baseline"
    by_key = {m.key: m.overrides for m in rep.MODES}
    assert by_key[rep.ROLLPACKER] == {"scheduler.mode": "tail_batching", "reward.async_scoring": "true",
                    "scheduler.planner.enabled": "true", "rollout.tp": "1", "trainer.stream": "true",
                    "scheduler.history.enabled": "false"}  # history: measured by bench.e2e.history
    sections = {"run": ("rollpacker/config.py", "RunSection"), "data": ("rollpacker/data/config.py", "DataConfig"),
                "rollout": ("rollpacker/rollout/config.py", "RolloutConfig"),
                "scheduler": ("rollpacker/scheduler/config.py", "SchedulerConfig"),
                "scheduler.planner": ("rollpacker/scheduler/config.py", "PlannerConfig"),
                "scheduler.history": ("rollpacker/scheduler/config.py", "HistoryConfig"),
                "reward": ("rollpacker/reward/config.py", "RewardConfig"),
                "trainer": ("rollpacker/trainer/config.py", "TrainerConfig")}
    keys = {k for m in rep.MODES for k in m.overrides} | {o.split("=")[0] for o in rep.seed_overrides(3)}
    for key in keys:
        section, name = key.rsplit(".", 1)
        assert name in _fields(*sections[section]), key


def test_checkpoint_time_is_not_step_time():
    assert rep.step_seconds(rec(1, "baseline", 10.0, ckpt=2.5)) == pytest.approx(10.0)


def test_warm_step_left_out_without_tilting_the_round_mix():
    # Warm first steps are slow (100 s); without the kind weighting, dropping step 1 and 6 (short rounds)
    # would give (3*2 + 10) / 4 = 4 s per step instead of the cycle's (4*2 + 10) / 5 = 3.6 s.
    recs = tail_run(2.0, 10.0)
    recs[0]["time/step_s"] = recs[5]["time/step_s"] = 100.0
    assert rep.kind_weighted_mean(recs, rep.step_seconds, {1, 6}) == pytest.approx(3.6)


def test_speedup_over_matching_trained_prompts():
    base = rep.mode_summary([rec(s, "baseline", 6.0) for s in range(1, 11)], {1, 6})
    tail = rep.mode_summary(tail_run(2.0, 10.0), {1, 6})
    assert base["prompts_trained"] == tail["prompts_trained"] == 160
    assert rep.speedup(base, tail) == pytest.approx(6.0 / 3.6)
    # A mode that trains half the prompts per step at the same step time is half as fast.
    half = rep.mode_summary([rec(s, "baseline", 6.0, prompts=8) for s in range(1, 11)])
    assert rep.speedup(base, half) == pytest.approx(0.5)


def test_summary_counts_waste_and_stream_activity():
    s = rep.mode_summary(tail_run(2.0, 10.0, wasted=100))
    assert s["wasted_tokens"] == 1000 and s["wasted_share"] == pytest.approx(0.1)
    assert s["rounds"] == {"short": 8, "long": 2} and not s["stream_active"]
    assert rep.mode_summary(tail_run(2.0, 10.0, stream_groups=3))["stream_active"]


def test_last_cycle_mean_is_over_trained_prompts():
    recs = [rec(s, "baseline", 1.0, reward=0.1 * s) for s in range(1, 11)]
    assert rep.last_cycle_mean(recs, "reward_mean", 80) == pytest.approx(0.8)  # steps 6..10
    assert math.isnan(rep.window_mean([16, 32], [1.0, 2.0], 32, 48))
    assert rep.trailing_means([16, 32, 48], [1.0, 2.0, 3.0], 32) == pytest.approx([1.0, 1.5, 2.5])


def test_trl_skip_reasons():
    assert rep.trl_skip_reason(True, True, None) == "--no-trl given"
    assert "does not exist" in rep.trl_skip_reason(False, False, None)
    assert "No module named 'trl'" in rep.trl_skip_reason(False, True, "ModuleNotFoundError: No module named 'trl'")
    assert rep.trl_skip_reason(False, True, None) is None
    assert "skipped (--no-trl given)" in rep.trl_markdown(None, "--no-trl given", {})


@pytest.mark.parametrize("prompts", [[16, 16, 16, 16], [16, 32, 48, 64]])
def test_trl_summary_per_step_or_cumulative_prompts(prompts):
    trl = {"seconds_per_step": [50.0, 10.0, 12.0, 14.0], "generation_seconds": [40.0, 6.0, 6.0, 6.0],
           "reward_mean": [0.1, 0.2, 0.3, 0.4], "accuracy": [0.0, 0.1, 0.2, 0.3], "prompts_trained": prompts,
           "trl_version": "1.16.0"}
    later = dict(trl, seconds_per_step=[50.0, 20.0, 24.0, 28.0], generation_seconds=[40.0, 12.0, 12.0, 12.0])
    t = rep.trl_summary([trl], (32, 64))
    assert t["step_s"] == pytest.approx(12.0) and t["s_per_prompt"] == pytest.approx(0.75)  # first step is warm-up
    assert t["generation_share"] == pytest.approx(0.5)
    assert t["prompts_trained"] == 64 and t["reward_window"] == pytest.approx(0.35)
    both = rep.trl_summary([trl, later], (32, 64))  # a run before and one after ours: seconds averaged
    assert both["step_s"] == pytest.approx(18.0) and both["step_s_runs"] == pytest.approx([12.0, 24.0])
    ours = {"step_s": 6.0, "s_per_prompt": 0.375, "rollout_s": 3.0, "reward_window": 0.3}
    md = rep.trl_markdown(t, None, [("RollPacker", ours)])
    assert "| RollPacker | 6.0 | 50% | 0.300 | – | 2.00× |" in md and "TRL 1.16.0" in md


def test_tables_format():
    rows = [{"key": m.key, "label": m.label, "summary": rep.mode_summary(tail_run(2.0, 10.0)), "speedup": 1.5,
             "note": "flag has no effect" if m.key == "stream" else "", "reward_last_cycle": 0.25,
             "held_out": 0.281}
            for m in rep.MODES]
    md = rep.ablation_markdown(rows).splitlines()
    assert len(md) == 2 + len(rep.MODES) and all(line.count("|") == 11 for line in md)
    assert "| + stream trainer (flag has no effect) | 3.6 | 1.50× | 2.03 / 2.22 / 2.56 |" in md[-1]
    assert "| 0.250 | 0.281 |" in md[-1]
    steps = [{"round": "short", "rollout_tp": 1}, {"round": "long", "rollout_tp": 1}, {"round": "long", "rollout_tp": 2}]
    assert rep.planned_tps(steps) == {"short": "1", "long": "1/2"}


def test_readme_block_renders_from_the_results_file_as_read_back():
    """The README block comes from bench/results/e2e.json after a JSON round trip (seed keys become strings)."""
    summary = rep.mode_summary(tail_run(2.0, 10.0), {1, 6})
    rows = [{"key": m.key, "label": m.label, "summary": summary, "speedup": 1.0, "note": "", "reward_last_cycle": 0.25,
             "held_out": 0.28} for m in rep.MODES]
    base, ours = {0: 0.30, 1: 0.20, 2: 0.25}, {0: 0.32, 1: 0.19, 2: 0.27}
    result = {"settings": {"p0": 16, "r0": 4, "steps": 10, "eval_n": 4}, "seed": 0, "trained_per_run": [160],
              "ablation": rows, "per_seed_speedup": {0: 1.25, 1: 1.6, 2: 1.28},
              "reward_parity": rep.paired_difference(base, ours), "held_out_pass": {"start": 0.285},
              "held_out_parity": rep.paired_difference(base, base), "rollpacker_window": summary,
              "trl": None, "trl_skip": "--no-trl given"}
    md = rep.readme_markdown(json.loads(json.dumps(result)))
    assert "steps 1, 6: engine and reward-pool start" in md and "trained prompts per run: [160]" in md
    assert "per seed: 1.25×, 1.60×, 1.28× (geometric mean 1.37×)" in md
    assert "s0 +0.020, s1 -0.010, s2 +0.020" in md and "over 3 seeds → **parity" in md
    assert "starting policy 0.285" in md and "TRL GRPOTrainer peer: skipped (--no-trl given)." in md


def test_paired_difference_interval_and_verdicts():
    base = {0: 0.30, 1: 0.20, 2: 0.25, 3: 0.35}
    same = rep.paired_difference(base, {s: v + d for (s, v), d in zip(base.items(), (0.01, -0.01, 0.02, -0.02))})
    assert same["n"] == 4 and same["mean"] == pytest.approx(0.0)
    # sample std of (0.01, -0.01, 0.02, -0.02) = 0.018257; t(3) = 3.182; half-width = 3.182 * 0.018257 / 2
    assert same["high"] == pytest.approx(3.182 * 0.0182574 / 2, rel=1e-4) and same["low"] == -same["high"]
    assert same["verdict"].startswith("parity")
    worse = rep.paired_difference(base, {s: v - 0.05 + 0.001 * s for s, v in base.items()})
    assert worse["verdict"] == "worse than the baseline" and worse["high"] < 0
    # a seed present on one side only is not paired
    one = rep.paired_difference({0: 0.3, 1: 0.2}, {1: 0.25, 7: 0.9})
    assert one["seeds"] == [1] and one["verdict"].startswith("no verdict")
    assert "+0.000" in rep.paired_text(same, "reward")


def test_by_epoch_splits_a_step_by_its_trained_prompts():
    steps = [([0, 0, 0, 0], {"s": 4.0}), ([0, 1, 1, 1], {"s": 8.0}), ([1, 1], {"s": 1.0})]
    out = rep.by_epoch(steps)
    assert out == {0: {"trained": 5.0, "s": 6.0}, 1: {"trained": 5.0, "s": 7.0}}


def test_mismatch_bench_sizes_the_gap_per_round_and_pairs_the_arms_by_seed(tmp_path):
    """bench/e2e/mismatch.py on synthetic runs: per-step metrics read back from metrics.jsonl, the gap's
    means per round kind and length bucket, long minus short paired by seed, arms paired by seed."""
    from bench.e2e import mismatch

    def run(arm: str, seed: int, k3: float, reward: float) -> dict:
        lines = [{"step": 0, "eval/greedy/pass@1": 1.0}]
        for step in (1, 2, 3, 4, 5):
            kind = "long" if step == 5 else "short"
            lines.append({"step": step, "round": kind, "reward_mean": reward, "train/grad_norm": 1.0 + seed,
                          "train/logprob_mismatch": 0.0, "mismatch/kl_k3": k3 * (2 if kind == "long" else 1),
                          f"mismatch/{kind}/kl_k3": 0.0, "mismatch/len_0_32/kl_k3": k3,
                          **{f"mismatch/{g}": 0.0 for g in mismatch.GAP if g != "kl_k3"}})
        path = tmp_path / f"{arm}-{seed}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        steps = mismatch.per_step(path)
        assert [s["round"] for s in steps] == ["short"] * 4 + ["long"] and "mismatch/short/kl_k3" not in steps[0]
        return {"arm": arm, "seed": seed, "steps": steps, "t1_end": reward, "greedy_end": 1.0,
                "curve": [{"step": 0, "t1_pass@1": 0.3}, {"step": 5, "t1_pass@1": reward}]}

    by_arm = {"bf16": [run("bf16", s, 1e-5 * (1 + s), 0.5) for s in (1, 2, 3)],
              "bf16_tis": [run("bf16_tis", s, 1e-5 * (1 + s), 0.5 + 0.1 * s) for s in (1, 2, 3)]}
    gap = mismatch.gap_size(by_arm["bf16"])
    print(gap["by_round"], gap["long_minus_short_kl_k3"])
    assert gap["by_round"]["short"]["kl_k3"] == pytest.approx(3e-5) and gap["by_round"]["long"]["kl_k3"] == pytest.approx(6e-5)
    assert gap["by_length"]["len_0_32"]["kl_k3"] == pytest.approx(3e-5)
    assert gap["long_minus_short_kl_k3"]["differences"] == pytest.approx([2e-5, 3e-5, 4e-5])
    cmp = mismatch.compare(by_arm, "bf16")["bf16_tis"]
    assert cmp["t1_pass@1"]["differences"] == pytest.approx([0.1, 0.2, 0.3])
    assert cmp["grad_norm_mean"]["differences"] == [0.0, 0.0, 0.0]
    r = {"command": "python -m bench.e2e.mismatch", "commit": "abc", "date": "2026-11-28T00:00:00+00:00",
         "machine": "x86_64, 2 cores", "load_average": [1, 1, 1],
         "gap": {a: mismatch.gap_size(runs) for a, runs in by_arm.items()}, "against_bf16": {"bf16_tis": cmp},
         "runs": [x for runs in by_arm.values() for x in runs]}
    text = mismatch.markdown(r)
    assert "| bf16 | long | " in text and "| bf16_tis − bf16: what the correction changes | +0.200" in text
    assert "- bf16: 3.00e-05 [" in text and "long rounds' gap larger" in text
