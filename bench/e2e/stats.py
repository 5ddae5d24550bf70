"""The pure logic of ``bench/e2e/ablation.py``: modes, timing estimators, paired parity statistic, tables.

No torch, no subprocesses: everything here works on ``metrics.jsonl`` records
(one dict per step) and small dicts, so ``tests/unit/test_e2e_bench.py`` checks it
with synthetic records in milliseconds.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

Record = dict[str, Any]

# The ablation, cumulative as in the published table; each mode is the previous one plus its overrides.
# History (ours, not in the published table) is measured on its own by bench.e2e.history.
_BASE = {"scheduler.mode": "baseline", "reward.async_scoring": "false", "scheduler.planner.enabled": "false",
         "rollout.tp": "1", "trainer.stream": "false", "scheduler.history.enabled": "false"}
_STEPS = [
    ("baseline", "baseline (synchronous, veRL-style)", {}),
    ("tail_batching", "tail batching", {"scheduler.mode": "tail_batching"}),
    ("async_reward", "+ async reward scheduler", {"reward.async_scoring": "true"}),
    ("planner", "+ parallelism planner", {"scheduler.planner.enabled": "true"}),
    ("stream", "+ stream trainer", {"trainer.stream": "true"}),
]


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    overrides: dict[str, str]

    def args(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.overrides.items()]


def _modes() -> list[Mode]:
    out, acc = [], dict(_BASE)
    for key, label, extra in _STEPS:
        acc = {**acc, **extra}
        out.append(Mode(key, label, dict(acc)))
    return out


MODES: list[Mode] = _modes()
BASELINE, ROLLPACKER = "baseline", "stream"  # ROLLPACKER: every component on, at the published settings
# NSDI'26 cumulative end-to-end speedups over veRL (7B / 14B / 32B).
PUBLISHED_ABLATION = {"baseline": (1.0, 1.0, 1.0), "tail_batching": (1.30, 1.48, 2.21),
                      "async_reward": (2.01, 1.99, 2.48), "planner": (2.01, 2.02, 2.52),
                      "stream": (2.03, 2.22, 2.56)}


def seed_overrides(seed: int) -> list[str]:
    """``run.seed`` only seeds Megatron's RNG; the data order is ``data.seed`` and the sampling
    ``rollout.seed``, so a seed sets all three (same seed: same order and draws in every mode)."""
    return [f"run.seed={seed}", f"data.seed={seed}", f"rollout.seed={seed}"]


def step_seconds(rec: Record) -> float:
    """Wall seconds of the step without its checkpoint (checkpoints fall where a process ends).

    Builds without ``time/step_s`` get the sum of the step's phase spans instead."""
    if "time/step_s" not in rec:
        return sum(float(v) for k, v in rec.items() if k.startswith("time/") and k != "time/checkpoint_s")
    return float(rec["time/step_s"]) - float(rec.get("time/checkpoint_s", 0.0))


def kind_weighted_mean(records: Sequence[Record], value: Any, warm: set[int] = frozenset()) -> float:
    """Mean of ``value(rec)`` with warm-up steps left out, without biasing the round mix.

    Dropping a warm-up step (the first of each process) from a tail-batching run
    would drop a short round and tilt the mean toward long rounds, so each round
    kind is averaged over its non-warm steps and weighted by its share of all steps.
    """
    by_kind: dict[str, list[Record]] = {}
    for rec in records:
        by_kind.setdefault(rec["round"], []).append(rec)
    total = 0.0
    for recs in by_kind.values():
        kept = [r for r in recs if r["step"] not in warm] or recs  # a kind seen only warm: keep it
        total += len(recs) / len(records) * statistics.fmean(float(value(r)) for r in kept)
    return total


def cumulative_prompts(records: Sequence[Record]) -> list[int]:
    out, n = [], 0
    for rec in records:
        n += int(rec["prompts_kept"])
        out.append(n)
    return out


def planned_tps(records: Sequence[Record]) -> dict[str, str]:
    """The rollout TP sizes each round kind ran at, in order of first use: {"short": "1", "long": "1/2"}."""
    seen: dict[str, list[int]] = {}
    for r in records:
        tps = seen.setdefault(r["round"], [])
        if r["rollout_tp"] not in tps:
            tps.append(r["rollout_tp"])
    return {kind: "/".join(map(str, tps)) for kind, tps in seen.items()}


def mode_summary(records: Sequence[Record], warm: set[int] = frozenset()) -> dict[str, Any]:
    step_s = kind_weighted_mean(records, step_seconds, warm)
    prompts_per_step = statistics.fmean(int(r["prompts_kept"]) for r in records)
    generated = sum(int(r["generated_tokens"]) for r in records)
    wasted = sum(int(r["wasted_tokens"]) for r in records)
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r["round"]] = kinds.get(r["round"], 0) + 1
    return {
        "steps": len(records), "rounds": kinds, "prompts_trained": cumulative_prompts(records)[-1],
        "step_s": step_s, "s_per_prompt": step_s / prompts_per_step,
        "rollout_s": kind_weighted_mean(records, lambda r: r["time/rollout_s"], warm),  # rollout + reward phase
        "train_s": kind_weighted_mean(records, lambda r: r["time/train_s"], warm),
        "bubble_fraction": kind_weighted_mean(records, lambda r: r["bubble_fraction"], warm),
        "generated_tokens": generated, "wasted_tokens": wasted, "wasted_share": wasted / max(1, generated),
        "warm_steps": sorted(warm),
        # The program's stream trainer reports groups trained before rollout ended; 0 everywhere = not active.
        "stream_active": any(float(r.get("train/stream_groups_before_rollout_end", 0)) > 0
                             or float(r.get("streamed_groups", 0)) > 0 for r in records),
    }


def speedup(base: dict[str, Any], mode: dict[str, Any]) -> float:
    """Baseline seconds per trained prompt / the mode's: the step-time ratio when both train P0 a step."""
    return base["s_per_prompt"] / mode["s_per_prompt"]


def window_mean(prompts: Sequence[int], values: Sequence[float], lo: float, hi: float) -> float:
    """Mean of the steps whose cumulative trained prompts lie in (lo, hi]; nan when none do."""
    picked = [float(v) for p, v in zip(prompts, values) if lo < p <= hi]
    return statistics.fmean(picked) if picked else math.nan


def last_cycle_mean(records: Sequence[Record], key: str, cycle_prompts: int) -> float:
    """Mean of ``key`` over the last cycle's trained prompts (tail batching trains the hard,
    deferred prompts in the long round, so only whole cycles compare with the baseline)."""
    cum = cumulative_prompts(records)
    return window_mean(cum, [r[key] for r in records], cum[-1] - cycle_prompts, cum[-1])


def trailing_means(prompts: Sequence[int], values: Sequence[float], cycle_prompts: int) -> list[float]:
    """At each step, the mean over the trailing cycle of trained prompts (for the plot)."""
    return [window_mean(prompts, values, p - cycle_prompts, p) for p in prompts]


def trl_skip_reason(no_trl: bool, script_exists: bool, import_error: str | None) -> str | None:
    """Why the TRL row is skipped, or None to run it."""
    if no_trl:
        return "--no-trl given"
    if not script_exists:
        return "bench/e2e/trl_grpo.py does not exist yet"
    if import_error is not None:
        return f"trl is not importable in the given python: {import_error}"
    return None


def trl_summary(runs: Sequence[dict[str, Any]], window: tuple[float, float]) -> dict[str, Any]:
    """TRL's seconds per step and per trained prompt (the first step of each run left out as warm-up
    when there are more) averaged over ``runs`` (the same run repeated before and after ours, so its
    seconds bracket the same machine load), its generation share, and the first run's reward and
    accuracy over the trained-prompt ``window`` (lo, hi]."""
    step_s, gen_share = [], []
    for trl in runs:
        sps, gen = [float(x) for x in trl["seconds_per_step"]], [float(x) for x in trl["generation_seconds"]]
        first = 1 if len(sps) > 1 else 0
        step_s.append(statistics.fmean(sps[first:]))
        gen_share.append(sum(gen[first:]) / sum(sps[first:]))
    pt = [int(x) for x in runs[0]["prompts_trained"]]
    # The contract does not say per step or cumulative: a strictly increasing list is cumulative.
    cumulative = len(pt) > 1 and all(b > a for a, b in zip(pt, pt[1:]))
    cum = pt if cumulative else [sum(pt[:i + 1]) for i in range(len(pt))]
    per_step = [b - a for a, b in zip([0] + cum, cum)]
    mean_s = statistics.fmean(step_s)
    return {"steps": len(pt), "runs": len(runs), "step_s": mean_s, "step_s_runs": step_s,
            "s_per_prompt": mean_s / statistics.fmean(per_step), "generation_share": statistics.fmean(gen_share),
            "prompts_trained": cum[-1], "reward_window": window_mean(cum, runs[0]["reward_mean"], *window),
            "accuracy_window": window_mean(cum, runs[0]["accuracy"], *window),
            "trl_version": runs[0].get("trl_version")}


# --- formatting ------------------------------------------------------------------------------------

def _f(x: float, fmt: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def ablation_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Rows: key, label, summary (mode_summary), speedup, note, reward_last_cycle, held_out (pass@1 of
    the final policy on held-out prompts). Published figures beside."""
    out = ["| component added | s/step | speedup | published 7B / 14B / 32B | rollout+reward s | train s "
           "| bubble | wasted tokens | reward (last cycle) | held-out pass@1 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, pub = r["summary"], PUBLISHED_ABLATION.get(r["key"])
        label = r["label"] + (f" ({r['note']})" if r.get("note") else "")
        out.append(f"| {label} | {s['step_s']:.1f} | {r['speedup']:.2f}× | "
                   f"{' / '.join(f'{x:.2f}' for x in pub) if pub else '–'} | {s['rollout_s']:.1f} | "
                   f"{s['train_s']:.1f} | {s['bubble_fraction']:.2f} | {s['wasted_tokens']} "
                   f"({100 * s['wasted_share']:.0f}%) | {_f(r.get('reward_last_cycle', math.nan), '.3f')} "
                   f"| {_f(r.get('held_out', math.nan), '.3f')} |")
    return "\n".join(out)


def trl_markdown(t: dict[str, Any] | None, skip: str | None, ours: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """TRL beside our runs (label, mode_summary plus reward_window/accuracy_window)."""
    if t is None:
        return f"TRL GRPOTrainer peer: skipped ({skip})."
    runs = " / ".join(f"{x:.1f}" for x in t["step_s_runs"])
    out = ["| | s/step | generation share (ours: rollout + reward) | reward (same trained prompts) | accuracy "
           "| vs TRL (s per trained prompt) |", "|---|---|---|---|---|---|",
           f"| TRL {t['trl_version']} GRPOTrainer | {t['step_s']:.1f} ({runs}) | {100 * t['generation_share']:.0f}% | "
           f"{_f(t['reward_window'], '.3f')} | {_f(t['accuracy_window'], '.3f')} | 1.00× |"]
    for label, s in ours:
        out.append(f"| {label} | {s['step_s']:.1f} | {100 * s['rollout_s'] / s['step_s']:.0f}% | "
                   f"{_f(s.get('reward_window', math.nan), '.3f')} | {_f(s.get('accuracy_window', math.nan), '.3f')} "
                   f"| {t['s_per_prompt'] / s['s_per_prompt']:.2f}× |")
    return "\n".join(out)


def readme_markdown(r: dict[str, Any]) -> str:
    """The README block of one ``bench.e2e.ablation`` results file (as read back from JSON: seed keys are strings)."""
    s = r["settings"]
    base = next(row for row in r["ablation"] if row["key"] == BASELINE)["summary"]
    timing = (f"seed {r['seed']}; seconds per step exclude each process's first step (steps "
              f"{', '.join(map(str, base['warm_steps']))}: engine and reward-pool start) and checkpoint writes, "
              f"per round kind weighted by its share of the run (4 short : 1 long); trained prompts per run: "
              f"{r['trained_per_run']}")
    out = [f"The real program, 2 CPU ranks, P0={s['p0']}, R0={s['r0']}, {s['steps']} steps; {timing}.", "",
           ablation_markdown(r["ablation"]), ""]
    speedups = list(r["per_seed_speedup"].values())
    if speedups:
        out += ["All components vs the baseline, per seed: " + ", ".join(f"{x:.2f}×" for x in speedups)
                + f" (geometric mean {math.exp(statistics.fmean(map(math.log, speedups))):.2f}×).", ""]
    out += ["Accuracy parity: " + paired_text(r["reward_parity"], "RollPacker's mean reward over the last cycle of "
                                              "trained prompts") + ".", ""]
    if r["held_out_parity"]:
        out += [f"Held-out pass@1 of the final policies ({s['eval_n']} samples per eval prompt"
                f"{f' on the first {n}' if (n := s.get('eval_prompts')) else ''}; starting policy "
                f"{r['held_out_pass']['start']:.3f}): " + paired_text(r["held_out_parity"], "RollPacker's") + ".", ""]
    trl = r["trl"]
    how = (f" (seed {r['seed']}; TRL s/step: mean over {trl['runs']} run(s), one before and one after ours, first "
           f"step of each left out)" if trl else "")
    out += [f"Against TRL{how}:", "", trl_markdown(trl, r["trl_skip"], [("RollPacker", r["rollpacker_window"])])]
    return "\n".join(out)


# Two-sided 95% Student-t quantiles by degrees of freedom (beyond 30 the normal's 1.96 is within 2%).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def _t95(df: int) -> float:
    return _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96


def paired_difference(baseline: dict[int, float], other: dict[int, float]) -> dict[str, Any]:
    """``other`` minus ``baseline`` at the same seed: the mean difference and its 95% t-interval.

    Pairing removes what the seed alone decides (data order, sampling draws), which dominates the
    seed-to-seed spread; parity holds when the interval contains 0. Seeds missing from either side
    are left out."""
    seeds = sorted(set(baseline) & set(other))
    diffs = [other[s] - baseline[s] for s in seeds]
    out: dict[str, Any] = {"seeds": seeds, "differences": diffs, "n": len(diffs)}
    if len(diffs) < 2:
        return {**out, "mean": diffs[0] if diffs else math.nan, "low": math.nan, "high": math.nan,
                "verdict": "no verdict: fewer than two paired seeds"}
    mean, half = statistics.fmean(diffs), _t95(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    verdict = "parity (the interval contains 0)" if mean - half <= 0 <= mean + half else (
        "better than the baseline" if mean - half > 0 else "worse than the baseline")
    return {**out, "mean": mean, "low": mean - half, "high": mean + half, "verdict": verdict}


def paired_text(p: dict[str, Any], what: str) -> str:
    per_seed = ", ".join(f"s{s} {d:+.3f}" for s, d in zip(p["seeds"], p["differences"]))
    return (f"{what}, minus the baseline at the same seed ({per_seed}): mean {p['mean']:+.3f}, "
            f"95% t-interval [{p['low']:+.3f}, {p['high']:+.3f}] over {p['n']} seeds → **{p['verdict']}**")


def by_epoch(steps: Sequence[tuple[Sequence[int], dict[str, float]]]) -> dict[int, dict[str, float]]:
    """Per-step values summed per epoch: each step is (the epochs of the prompts it trained, its values),
    and is split between epochs by their share of its trained prompts. Adds ``trained`` per epoch."""
    out: dict[int, dict[str, float]] = {}
    for epochs, values in steps:
        for epoch in sorted(set(epochs)):
            share = sum(e == epoch for e in epochs) / len(epochs)
            row = out.setdefault(epoch, {"trained": 0.0})
            row["trained"] += share * len(epochs)
            for key, v in values.items():
                row[key] = row.get(key, 0.0) + share * float(v)
    return dict(sorted(out.items()))
