"""The generated tables of README.md and docs/, rendered from the raw results in ``bench/results/``.

    python -m bench.tools.report           # rewrite every generated block of README.md and docs/*.md
    python -m bench.tools.report --check   # exit 1 if a block differs from what its results file gives

A generated block sits between ``<!-- bench.tools.report NAME -->`` and
``<!-- /bench.tools.report -->`` and is produced only from ``bench/results/NAME.json``,
whose command, commit, date, machine and load average it prints;
``tests/unit/test_readme_figures.py`` runs ``--check``, so a figure in such a block
cannot drift from its raw result.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from typing import Any, Callable

from bench.e2e import mismatch, stats
from bench.micro import engine_invariance
from bench.tools.results import REPO

RESULTS = REPO / "bench" / "results"
ROLLPACKER_ROW = stats.ROLLPACKER  # the ablation row with every component on
README = REPO / "README.md"
# the files that hold generated blocks: the front page's headline and docs/results.md's full tables
PAGES = (README, REPO / "docs" / "results.md", REPO / "docs" / "gpu.md", REPO / "docs" / "sglang.md",
         REPO / "docs" / "slurm.md", REPO / "docs" / "mismatch.md")
BLOCK = re.compile(r"(<!-- bench\.tools\.report (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench\.tools\.report -->)", re.S)


def provenance(r: dict[str, Any]) -> str:
    load = (f", load average {', '.join(f'{x:.1f}' for x in r['load_average'])} (1/5/15 min) at the end"
            if "load_average" in r else "")
    return f"`{r['command']}` at {r['commit']}, {r['date'][:10]}, {r['machine']}{load}"


def rollout(r: dict[str, Any]) -> str:
    """bench.system.rollout: baseline vs tail batching on the reference engine, per round kind and amortized."""
    def seconds(rounds: list[dict[str, Any]], kind: str | None = None) -> list[float]:
        return [x["rollout_seconds"] + x["reward_seconds"] for x in rounds if kind in (None, x["kind"])]

    base, tail = r["rounds"]["baseline"], r["rounds"]["tail_batching"]
    throughput = statistics.fmean(r["throughput"])
    s = r["settings"]

    def bound_share(rounds: list[dict[str, Any]]) -> float:
        return sum(x["generated_tokens"] for x in rounds) / throughput / sum(seconds(rounds))

    base_s, short_s = statistics.fmean(seconds(base)), statistics.fmean(seconds(tail, "short"))
    tokens = [sum(x["generated_tokens"] for x in rounds) for rounds in (base, tail)]
    busy, exposed = (sum(x[k] for x in tail) for k in ("reward_busy", "reward_exposed"))
    same = "both modes trained the same prompts" if r["same_prompts"]["tail_batching"] else "**the modes trained different prompts**"
    replay = (f"every response's length replayed (stop tokens ignored) from the parametric long-tail model, median "
              f"{s['replay_median']:g} tokens of a {s['limit']}-token limit; " if s.get("replay_median") else
              f"every response's length replayed from `{s['replay_trace']}`; " if s.get("replay_trace") else "")
    return "\n".join([
        f"P0={s['p0']}, R0={s['r0']}, η={s['eta']}, {s['cycles']} cycles of 4 short + 1 long round, "
        f"{s['threads']} thread(s); {replay}{same}; {provenance(r)}:", "",
        "| | baseline | tail batching | ratio |", "|---|---|---|---|",
        f"| short round | {base_s:.2f} s | {short_s:.2f} s | {base_s / short_s:.2f}× |",
        f"| long round | – | {statistics.fmean(seconds(tail, 'long')):.2f} s | |",
        f"| amortized over {len(base)} rounds | {sum(seconds(base)):.1f} s | {sum(seconds(tail)):.1f} s "
        f"| {sum(seconds(base)) / sum(seconds(tail)):.2f}× |",
        f"| generated tokens | {tokens[0]} | {tokens[1]} | {tokens[1] / tokens[0]:.2f}× |",
        f"| bubble fraction | {statistics.fmean(x['bubble_fraction'] for x in base):.2f} "
        f"| {statistics.fmean(x['bubble_fraction'] for x in tail):.2f} | |",
        f"| share of the bubble-free bound reached | {bound_share(base):.0%} | {bound_share(tail):.0%} | |", "",
        f"Bubble-free bound: a mode's generated tokens at the engine's saturated throughput, measured before and "
        f"after the rounds ({' / '.join(f'{t:.0f}' for t in r['throughput'])} tokens/s). Reward scored as "
        f"responses finish (tail batching): {1 - exposed / busy:.0%} of the {busy:.2f} s of scoring was hidden "
        f"behind generation ({exposed:.2f} s after the last response of a round)."])


def rollout_history(r: dict[str, Any]) -> str:
    """bench.system.rollout --history: per mode, waste by epoch, amortized speedup and share of the true bound."""
    epochs = r["epochs"]
    throughput = statistics.fmean(r["throughput"])
    base_rounds = r["rounds"]["baseline"]
    base_total = sum(x["rollout_seconds"] + x["reward_seconds"] for x in base_rounds)
    bound = sum(x["batch_tokens"] for x in base_rounds) / throughput
    names = {"baseline": "baseline (synchronous)", "tail_batching": "tail batching",
             "history": "tail batching + history"}
    s = r["settings"]
    lines = [f"{s['prompts']} prompts × {s['epochs']} epochs, P0={s['p0']}, R0={s['r0']}, η={s['eta']}, "
             f"eta_r_seen={s['eta_r_seen']}; {provenance(r)}:", "",
             "| mode | wasted tokens, epoch 0 | wasted, epochs 1+ | amortized speedup | share of the true bound |",
             "|---|---|---|---|---|"]
    for mode, rounds in r["rounds"].items():
        total = sum(x["rollout_seconds"] + x["reward_seconds"] for x in rounds)
        rows = epochs[mode]
        later = [rows[e] for e in rows if e != "0"]
        waste_later = sum(x["wasted_tokens"] for x in later) / max(1.0, sum(x["generated_tokens"] for x in later))
        first = rows["0"]["wasted_tokens"] / max(1.0, rows["0"]["generated_tokens"])
        lines.append(f"| {names.get(mode, mode)} | {first:.0%} | {waste_later:.0%} | {base_total / total:.2f}× "
                     f"| {bound / total:.0%} |")
    lines += ["", f"True bound: the baseline's trained tokens at the saturated throughput measured before and "
                  f"after the rounds ({' / '.join(f'{t:.0f}' for t in r['throughput'])} tokens/s); the baseline "
                  f"itself reaches {bound / base_total:.0%} of it, so no mode can exceed "
                  f"{base_total / bound:.2f}× here."]
    return "\n".join(lines)


def history_sim(r: dict[str, Any]) -> str:
    """bench.system.history: per trace, tail batching with and without history on the modeled cluster."""
    s, h = r["settings"], r["history"]
    lines = [f"Qwen2.5-{s['model'].upper()}, {s['gpus']} modeled H800, P0={s['p0']}, R0={s['r0']}, η={s['eta']}, "
             f"{s['num_prompts']} prompts × {s['epochs']} epochs, {s['seeds']} seed(s); history margin {h['margin']}, "
             f"eta_p_seen {h['eta_p_seen']}, eta_r_seen {h['eta_r_seen']}; {provenance(r)}:", "",
             "| trace (realized epoch-to-epoch Spearman) | wasted tokens, epochs 1+: tail batching → + history "
             "| speedup over the baseline: tail batching / + history | history ÷ tail batching | routed |",
             "|---|---|---|---|---|"]
    for case in r["cases"]:
        m = case["mean"]
        later = m["per_epoch"][1:]
        waste = [statistics.fmean(e[k] for e in later) for k in ("wasted_tail", "wasted_tail_history")]
        t = m["total"]
        lines.append(f"| {case['case']} ({m['realized_spearman']:.2f}) | {waste[0]:.0%} → {waste[1]:.0%} "
                     f"| {t['speedup_tail']:.2f}× / {t['speedup_tail_history']:.2f}× | {t['history_over_tail']:.3f} "
                     f"| {m['routed']:.0f} |")
    return "\n".join(lines)


def e2e_history(r: dict[str, Any]) -> str:
    """bench.e2e.history: the real program over several epochs, with the paired accuracy statistic."""
    s = r["settings"]
    lines = [f"The real program (2 CPU ranks), {s['prompts']} prompts × {s['epochs']} epochs, P0={s['p0']}, "
             f"R0={s['r0']}, seeds {s['seeds']}; {provenance(r)}:", "",
             "| mode | wasted tokens by epoch | speedup by epoch (s per trained prompt, mean over seeds) "
             "| speedup over the run (geometric mean over seeds; per seed) "
             "| last-epoch reward − baseline (95% CI) | held-out pass@1 − baseline (95% CI) |",
             "|---|---|---|---|---|---|"]
    seeds = [int(x) for x in str(s["seeds"]).split(",")]

    def per_prompt(key: str, epoch: int) -> float:
        return statistics.fmean(r["runs"][f"{key}-s{seed}"]["epochs"][str(epoch)]["step_s_per_prompt"]
                                for seed in seeds)
    for key, m in r["modes"].items():
        if key == "baseline":
            continue
        waste = " / ".join(f"{v:.0%}" for v in m["wasted_fraction_per_epoch"].values())
        per_seed = ", ".join(f"{v:.2f}" for v in m["speedup_per_seed"].values())
        by_epoch = " / ".join(f"{per_prompt('baseline', e) / per_prompt(key, e):.2f}×" for e in range(s["epochs"]))

        def ci(p: dict[str, Any] | None) -> str:
            if not p or math.isnan(p["low"]):
                return "–"
            return f"{p['mean']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}]"

        label = "RollPacker, all components (tail batching, no history)" if key == "stream" else m["label"]
        lines.append(f"| {label} | {waste} | {by_epoch} | {m['speedup_geomean']:.2f}× ({per_seed}) | {ci(m['reward_parity'])} "
                     f"| {ci(m.get('held_out_parity'))} |")
    lines += ["", f"Amdahl ceiling here (baseline step seconds / its training seconds, the speedup if rollout cost "
                  f"nothing): {r['amdahl_ceiling']:.2f}×."]
    return "\n".join(lines)


def e2e(r: dict[str, Any]) -> str:
    """bench.e2e.ablation: the ablation, the speedup per seed, paired accuracy parity and the TRL peer."""
    return f"{provenance(r)}.\n\n{stats.readme_markdown(r)}"


def sim(r: dict[str, Any]) -> str:
    """bench.system.sim: rollout seconds on the modeled cluster at the published settings, beside the published ones."""
    s, t, models = r["settings"], r["settings"]["trace"], r["models"]
    lines = [f"The real scheduler over modeled H800 engines (`rollpacker.sim`); {provenance(r)}:", "",
             "| model, limit, GPUs | published rollout s (×) | simulated rollout s (×) | + planner (×) "
             "| published end-to-end: tail batching / all |", "|---|---|---|---|---|"]
    for m in models:
        pub, tail, plan = m["published"], m["mean"]["tail_batching"], m["mean"]["planner"]
        lines.append(f"| Qwen2.5-{m['model'].upper()}, {m['limit'] // 1024}k, {m['gpus']} "
                     f"| {pub['baseline_s']:.0f} → {pub['tail_s']:.0f} ({pub['speedup']:.2f}×) "
                     f"| {tail['baseline_mean_s']:.0f} → {tail['tail_mean_s']:.0f} ({tail['speedup']:.2f}×) "
                     f"| {plan['tail_mean_s']:.0f} ({plan['speedup']:.2f}×) "
                     f"| {pub['e2e_tail_batching']:.2f}× / {pub['e2e_all']:.2f}× |")
    base = [m["mean"]["tail_batching"]["baseline_mean_s"] / m["published"]["baseline_s"] for m in models]
    ratio = [m["speedup_ratio"] for m in models]
    lines += ["", f"Assumptions: P0={s['p0']}, R0={s['r0']}, η={s['eta_p']}, rollout TP "
                  f"{'/'.join(str(m['tp']) for m in models)} on {'/'.join(str(m['gpus']) for m in models)} modeled "
                  f"H800s (the planner may change it per round kind), {s['rounds']} rounds per mode (4 short + 1 long "
                  f"per cycle), {s['seeds']} seed(s); lengths from the log-normal long-tail model of "
                  f"`bench/system/sim.py` (median = limit/{t['median_divisor']}, σ {t['sigma_prompt']} per prompt × "
                  f"{t['sigma_response']} per response). This table is the rollout alone (reward, training and weight "
                  "sync are in the whole-step table below), so its ratios compare with the published rollout figures. "
                  "The model's baseline "
                  f"is {min(base):.2f}–{max(base):.2f}× the published seconds (its step-time model is optimistic), so "
                  f"its ratios are {min(ratio):.2f}–{max(ratio):.2f}× the published ones."]
    return "\n".join(lines)


def sim_step(r: dict[str, Any]) -> str:
    """bench.system.sim_step: the whole step on the modeled cluster, the ablation beside the published one."""
    from rollpacker.sim.step import ABLATION

    s, c, models = r["settings"], r["settings"]["costs"], r["models"]
    head = " | ".join(f"Qwen2.5-{m['model'].upper()}, {m['limit'] // 1024}k, {m['gpus']} GPUs" for m in models)
    lines = [f"The whole step: the real scheduler over modeled H800 engines, reward, training and weight sync "
             f"costed per step (`rollpacker.sim.step`); {provenance(r)}. Each cell: simulated × (published ×) "
             "over the synchronous baseline, cumulative:", "",
             f"| component added | {head} |", "|---|" + "---|" * len(models)]
    for component in ABLATION:
        lines.append(f"| {component.label} | " + " | ".join(
            f"{m['summary'][component.key]['speedup']:.2f}× ({m['published'][component.key]:.2f}×)"
            for m in models) + " |")
    lines += ["", "Seconds per step, simulated (rollout + reward stage + training after rollout + weight sync):", "",
              f"| | {head} |", "|---|" + "---|" * len(models)]
    for component in ABLATION:
        lines.append(f"| {component.label} | " + " | ".join(
            "{rollout_s:.0f} + {reward_s:.0f} + {train_s:.0f} + {sync_s:.0f} = **{step_s:.0f}**".format(
                **m["summary"][component.key]) for m in models) + " |")
    lines += ["", f"Costs: training at MFU {c['mfu']} ({c['flops_per_token']:g} × params FLOPs per trained token: "
                  f"forward, backward and the old log-probs), on every GPU; weight sync {c['switch_s']:g} s + the bf16 "
                  f"weights at {c['sync_bytes_per_s'] / 1e9:g} GB/s; reward {c['reward_s']:g} s per response on "
                  f"{c['reward_workers']} CPU workers, except half the responses of {c['reward_hang_prompts']:.0%} of "
                  f"the prompts, which run into the scorer's {c['reward_hang_s']:g} s timeout. P0={s['p0']}, "
                  f"R0={s['r0']}, η={s['eta_p']}, {s['rounds']} steps per row, lengths as in the rollout projection "
                  "above.", "", "Why the simulated rows differ from the published ones:", ""]
    for m in models:
        pub, base, tail = m["published_rollout_s"], m["summary"]["baseline"], m["summary"]["tail_batching"]
        k = m["published"]["tail_batching"]
        rest = (pub["baseline"] - k * pub["tail_batching"]) / (k - 1)  # the step's non-rollout seconds it implies
        long = {key: statistics.fmean(x["rollout_s"] for x in m["steps"][key] if x["kind"] == "long")
                for key in ("tail_batching", "planner")}
        tps = "/".join(sorted({str(x["tp"]) for x in m["steps"]["planner"] if x["kind"] == "long"}))
        planner = (f"The planner's long rounds run at TP {tps} in {long['planner']:.0f} s against "
                   f"{long['tail_batching']:.0f} s at TP {m['tp']}: " + (
                       "the modeled decode step is bound by reading the weights, which a wider TP group divides, "
                       "at little all-reduce cost, so the model credits the planner with more than the published "
                       "runs measured." if long["planner"] < 0.9 * long["tail_batching"] else
                       "little changes, as in the published runs."))
        lines.append(
            f"- Qwen2.5-{m['model'].upper()}: the modeled baseline rollout is {base['rollout_s']:.0f} s (published "
            f"{pub['baseline']:.0f} s) and tail batching's {tail['rollout_s']:.0f} s ({pub['tail_batching']:.0f} s). "
            f"The published rollout seconds and tail batching's {k:.2f}× end to end imply {rest:.0f} s per step "
            f"outside rollout; the model has {base['step_s'] - base['rollout_s']:.0f} s (reward stage "
            f"{base['reward_s']:.0f}, training {base['train_s']:.0f}, sync {base['sync_s']:.0f}): the parametric "
            f"lengths (median = limit/{t_div(s)}) train fewer tokens than the published runs' responses, so the "
            f"rollout gains are less diluted. {planner}")
    return "\n".join(lines)


def t_div(settings: dict[str, Any]) -> int:
    return settings["trace"]["median_divisor"]


def cpu_decode_bound_figures(r: dict[str, Any]) -> dict[str, float]:
    """The decode-cost model's and the program's rollout and step figures of bench.system.cpu_decode_bound."""
    m = r["measured"]
    base = statistics.fmean(x for run in r["modeled"] for x in run["baseline"])
    tail = statistics.fmean(x for run in r["modeled"] for x in run["tail_batching"])
    rest_b, rest_t = (m[k]["step_s"] - m[k]["rollout_s"] for k in ("baseline", "tail_batching"))
    return {"model_base": base, "model_tail": tail, "model_rollout_x": base / tail,
            "model_step_base": base + rest_b, "model_step_tail": tail + rest_t,
            "model_e2e_x": (base + rest_b) / (tail + rest_t),
            "rollout_x": m["baseline"]["rollout_s"] / m["tail_batching"]["rollout_s"],
            "e2e_x": m["baseline"]["step_s"] / m["tail_batching"]["step_s"]}


def cpu_decode_bound(r: dict[str, Any]) -> str:
    """bench.system.cpu_decode_bound: what the engine's decode cost lets tail batching gain here, beside the program."""
    s, f, t, m = r["settings"], r["fit"], r["trace"], r["measured"]
    x = cpu_decode_bound_figures(r)
    share_b, share_t = x["model_base"] / m["baseline"]["rollout_s"], x["model_tail"] / m["tail_batching"]["rollout_s"]
    return "\n".join([
        f"The reference engine's decode step here, with {s['engines']} engines at once as in the example, fitted over "
        f"batch × context ({len(r['sweep'])} points, {s['threads']} thread each): {1e3 * f['step_s']:.2f} ms + B × "
        f"({1e3 * f['per_request_s']:.3f} ms + {1e6 * f['per_context_token_s']:.2f} µs × context tokens) (median "
        f"error {f['median_relative_error']:.0%}, largest {f['max_relative_error']:.0%}); prefill "
        f"{1e6 * f['prefill_per_token_s']:.1f} µs per token. The example's lengths (`{t['file']}`, the shipped policy "
        f"at temperature 1): median {t['median']:.0f}, mean {t['mean']:.0f}, longest {t['max']} tokens "
        f"({t['max'] / t['median']:.0f}× the median), σ of log length within a prompt {t['sigma_log_within_prompt']:.2f} "
        f"(the published traces: ~25–32× and ~0.65). {provenance(r)}:", "",
        "| | baseline rollout | tail batching rollout | rollout × | s/step: baseline / tail batching | end to end × |",
        "|---|---|---|---|---|---|",
        f"| the program, measured (`{r['measured_from']['command']}` at {r['measured_from']['commit']}) "
        f"| {m['baseline']['rollout_s']:.2f} s | {m['tail_batching']['rollout_s']:.2f} s | {x['rollout_x']:.2f}× "
        f"| {m['baseline']['step_s']:.2f} / {m['tail_batching']['step_s']:.2f} s | {x['e2e_x']:.2f}× |",
        f"| the decode-cost model: the real scheduler on {s['engines']} modeled engines at this cost "
        f"({s['seeds']} seeds) | {x['model_base']:.2f} s | {x['model_tail']:.2f} s | {x['model_rollout_x']:.2f}× "
        f"| {x['model_step_base']:.2f} / {x['model_step_tail']:.2f} s | {x['model_e2e_x']:.2f}× |", "",
        f"P0={s['p0']}, R0={s['r0']}, {s['steps']} steps, limit {s['limit']} tokens, as in the end-to-end run; the "
        "model's step adds the program's measured seconds outside rollout to the modeled rollout. The engines' decode "
        f"accounts for {share_b:.0%} of the program's baseline rollout seconds and {share_t:.0%} of tail batching's; "
        f"the rest ({m['baseline']['rollout_s'] - x['model_base']:.2f} s and "
        f"{m['tail_batching']['rollout_s'] - x['model_tail']:.2f} s a round) is time outside decoding (the "
        "coordinator, polling, scoring, cores shared with the reward workers), and tail batching cuts it too, so "
        "the model's ratio is no upper bound on the program's here. What it does bound is the gain from decode "
        "time: on this CPU a decode step's cost grows with the batch, so the batch a long tail leaves idle is not "
        "free capacity as on a GPU, and the example's lengths have a short tail and little spread within a prompt."])


def stream(r: dict[str, Any]) -> str:
    """bench.system.stream: one long round, the stream trainer against rank 1 generating to the end, per repeat."""
    s, reps = r["settings"], r["repeats"]
    lines = [f"One long round ({s['round']}) of {s['prompts']} prompts × {s['responses']} responses per repeat, "
             f"hand-off window {s['trigger'][0]:.0%}–{s['trigger'][1]:.0%} of the requests; {provenance(r)}:", "",
             "| repeat | response tokens (median, longest) | step s: baseline / stream | baseline ÷ stream "
             "| rollout s: baseline / stream "
             "| training after rollout s: baseline / stream | hand-off at | migrated: requests, tokens "
             "| training before rollout end | weight Δ (relative) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, x in enumerate(reps):
        b, t = x["baseline"], x["stream"]
        lengths = b["lengths"]  # the stream mode's are the same samples (weight Δ shows it)
        lines.append(f"| {i} | {sum(lengths)} ({statistics.median(lengths):g}, {max(lengths)}) "
                     f"| {b['step_s']:.1f} / {t['step_s']:.1f} | {b['step_s'] / t['step_s']:.2f}× "
                     f"| {b['rollout_s']:.1f} / {t['rollout_s']:.1f} "
                     f"| {b['step_s'] - b['rollout_s']:.1f} / {t['step_s'] - t['rollout_s']:.1f} "
                     f"| {t['handoff_fraction']:.0%} | {t['migrated_requests']}, {t['migrated_tokens']} "
                     f"| {t['overlap_share']:.0%} | {x['weight_rel_diff']:.1e} |")
    ratios = [x["baseline"]["step_s"] / x["stream"]["step_s"] for x in reps]
    rollout = [statistics.median(x[m]["rollout_s"] for x in reps) for m in ("baseline", "stream")]
    after = [statistics.median(x[m]["step_s"] - x[m]["rollout_s"] for x in reps) for m in ("baseline", "stream")]
    lines += ["", f"Medians: baseline ÷ stream {statistics.median(ratios):.2f}× (range {min(ratios):.2f}–"
                  f"{max(ratios):.2f}×); rollout {rollout[0]:.1f} / {rollout[1]:.1f} s; training after rollout "
                  f"{after[0]:.1f} / {after[1]:.1f} s. {r['caveat']}."]
    return "\n".join(lines)


def trainer_run(r: dict[str, Any]) -> str:
    """The CPU trainer benchmarks' settings and provenance."""
    s = r["settings"]
    return (f"{s['steps']} steps of {s['prompts']} × {s['responses']} samples, forward + backward of the shipped "
            f"policy, micro-batch budget {s['micro_batch_tokens']} tokens, {s['threads']} thread(s); {provenance(r)}")


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}–{max(ratios):.2f}×"


def packing(r: dict[str, Any]) -> str:
    """bench.micro.packing: the CPU trainer's padded micro-batches packed by real tokens vs by padded cost."""
    steps = r["steps"]
    real = sum(x["real_tokens"] for x in steps)
    lines = [f"{trainer_run(r)}:", "",
             "| packing of the padded (CPU) micro-batches | seconds | padded tokens | micro-batches |",
             "|---|---|---|---|"]
    for mode, label in (("tokens", "first-fit decreasing by real tokens (before)"),
                        ("padded", "length-sorted runs of least padded cost (now)")):
        total = {k: sum(x[mode][k] for x in steps) for k in ("seconds", "padded_tokens", "micro_batches")}
        lines.append(f"| {label} | {total['seconds']:.2f} | {total['padded_tokens'] / real:.2f}× real "
                     f"| {total['micro_batches']} |")
    per_step = [x["tokens"]["seconds"] / x["padded"]["seconds"] for x in steps]
    lines.append(f"| ratio | {r['ratio']:.2f}× (per step {spread(per_step)}) | | |")
    return "\n".join(lines)


def logprob(r: dict[str, Any]) -> str:
    """bench.micro.logprob: the loss's entropy from the log-prob's own pass vs a second pass over the logits."""
    lines = [f"{r['tokens']} tokens x {r['vocab']:,} vocabulary, forward + backward, {r['threads']} thread(s); "
             f"{provenance(r)}:", "",
             "| logits | two passes (before) | one pass (now) | ratio | largest difference |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        m = row["median_s"]
        lines.append(f"| {row['dtype']} | {m['two_passes']:.2f} s | {m['one_pass']:.2f} s | "
                     f"{row['two_over_one']:.2f}× | {row['max_abs_difference']:.1e} |")
    return "\n".join(lines)


def attention(r: dict[str, Any]) -> str:
    """bench.micro.attention: Megatron's unfused DotProductAttention vs fused SDPA on the same micro-batches."""
    steps = r["steps"]
    lines = [f"{trainer_run(r)}:", "",
             "| workload | tokens | Megatron `DotProductAttention` | SDPA | ratio (per step) |",
             "|---|---|---|---|---|"]
    for name, ratio in r["ratio"].items():
        rows = [x[name] for x in steps]
        seconds = {m: sum(x[m]["seconds"] for x in rows) for m in ("megatron", "sdpa")}
        lines.append(f"| {name} | {sum(x['tokens'] for x in rows):,} | {seconds['megatron']:.2f} s "
                     f"| {seconds['sdpa']:.2f} s | {ratio:.2f}× "
                     f"({spread([x['megatron']['seconds'] / x['sdpa']['seconds'] for x in rows])}) |")
    return "\n".join(lines)


def engine(r: dict[str, Any]) -> str:
    """bench.micro.engine: the reference engine vs transformers' static-batch generate, best of interleaved repeats."""
    s = r["settings"]
    lines = [f"Model {r['model']}, batch {s['batch']}, {s['threads']} thread(s), greedy, best of {s['repeats']} "
             f"interleaved repeats; {provenance(r)}:", "",
             "| workload | reference engine | transformers `generate` | ratio (per repeat) |", "|---|---|---|---|"]
    for w in r["workloads"]:
        n, best = w["output_length"], w["best"]
        per_repeat = spread([t["engine_tok_s"] / t["transformers_tok_s"] for t in w["trials"]])
        lines.append(f"| {w['workload']} ({w['requests']} requests, output median {n['median']}, max {n['max']} "
                     f"tokens) | {best['engine_tok_s']:.0f} tok/s | {best['transformers_tok_s']:.0f} tok/s "
                     f"| {w['ratio']:.2f}× ({per_repeat}; goal ≥ {w['goal']:.1f}×: "
                     f"{'met' if w['ratio'] >= w['goal'] else 'not met'}) |")
    return "\n".join(lines)


def reward(r: dict[str, Any]) -> str:
    """bench.micro.reward: the reward pool vs scoring in the trainer, the adaptive code timeout vs a fixed one."""
    lines = [f"{provenance(r)}:", "", "| benchmark | baseline | RollPacker | ratio |", "|---|---|---|---|"]
    if m := r.get("math"):
        lines.append(f"| math-verify, {m['samples']:,} samples | in-process {m['in_process_s']:.0f} s "
                     f"| {m['workers']} workers {m['pool_s']:.0f} s (+{m['pool_startup_s']:.1f} s start-up) "
                     f"| {m['speedup']:.2f}× |")
    if c := r.get("code"):
        for name, a in c["adaptive"].items():
            lines.append(f"| code, {c['samples']} samples, {c['loops']} loop forever | fixed {c['t_max']:g} s "
                         f"timeout: {c['fixed_s']:.1f} s | {name}: {a['seconds']:.1f} s ({a['correct_cut']} correct "
                         f"solutions cut) | {a['speedup']:.2f}× |")
    return "\n".join(lines)


def race_bias(r: dict[str, Any]) -> str:
    """bench.e2e.race_bias: held-out pass@1 per configuration and seed, paired against the baseline."""
    seeds = [str(s) for s in r["seeds"]]
    lines = [f"Held-out pass@1, {r['settings']['eval_n']} samples per prompt, starting policy "
             f"{r['start']['pass_at_1']:.3f}; {provenance(r)}:", "",
             "| configuration | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | paired Δ vs baseline (95% CI) |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for key, runs in r["runs"].items():
        scores = [runs[s]["pass_at_1"] for s in seeds]
        p = r["paired"].get(key)
        delta = f"{p['mean']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}]" if p else ""
        lines.append(f"| {key} | " + " | ".join(f"{x:.3f}" for x in scores) + f" | {statistics.fmean(scores):.3f} "
                     f"| {delta} |")
    return "\n".join(lines)


# The full GPU acceptance run the front page quotes (docs/gpu/README.md lists every run and what it fixed).
GPU_RUN = "docs/gpu/2026-11-23-h100-b/run3-acceptance.json"


def _speedup_and_parity(r: dict[str, Any], parity: str = "reward_parity", what: str = "reward") -> str:
    """bench.e2e.ablation's every-component speedup over its seeds, and one of its paired accuracy statistics."""
    speedups, p = list(r["per_seed_speedup"].values()), r[parity]
    geo = math.exp(statistics.fmean(map(math.log, speedups)))
    return (f"{geo:.2f}× s/step over the synchronous baseline (per seed {min(speedups):.2f}–{max(speedups):.2f}×); "
            f"{what} difference {p['mean']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}] (95% paired "
            f"interval): {p['verdict'].split(' (')[0]}")


def headline() -> str:
    """README's front-page table: one line per kind of evidence, each linking to its full block and
    saying whether its figure is the rollout alone or the whole step."""
    e2e_r, recheck_r, shape, sim_r, step_r, control_r, decode_r = (
        json.loads((RESULTS / f"{n}.json").read_text())
        for n in ("e2e", "e2e_recheck", "policy_recheck", "sim", "sim_step", "control", "cpu_decode_bound"))
    decode = cpu_decode_bound_figures(decode_r)
    gpu = json.loads((REPO / GPU_RUN).read_text())
    checks = gpu["checks"]
    passed = sum(c["ok"] for c in checks.values())
    program = checks["program/baseline_vs_tail_batching"]
    trainer = gpu["checks"]["qwen2.5-0.5b-shape/trainer_throughput"]
    sims = ", ".join(f"{m['model'].upper()} {m['mean']['tail_batching']['speedup']:.2f}× "
                     f"({m['mean']['planner']['speedup']:.2f}× with the planner)" for m in sim_r["models"])
    steps = ", ".join(f"{m['model'].upper()} {m['summary'][ROLLPACKER_ROW]['speedup']:.2f}× (published "
                      f"{m['published'][ROLLPACKER_ROW]:.2f}×)" for m in step_r["models"])
    return "\n".join([
        "| evidence | figure | where |", "|---|---|---|",
        f"| CPU, end to end (the real program, 2 ranks, {len(e2e_r['per_seed_speedup'])} seeds) | "
        f"{_speedup_and_parity(e2e_r)}. From decode time alone (this engine's fitted cost, the example's "
        f"lengths) tail batching gains {decode['model_rollout_x']:.2f}× rollout, {decode['model_e2e_x']:.2f}× end "
        f"to end (measured: {decode['rollout_x']:.2f}× and {decode['e2e_x']:.2f}×) "
        f"| [results: end to end](docs/results.md#end-to-end), `{e2e_r['command']}` at {e2e_r['commit']}; "
        f"[decode-cost model](docs/results.md#what-decode-time-allows-on-this-cpu), `{decode_r['command']}` at "
        f"{decode_r['commit']} |",
        f"| CPU, end to end on reasoning-shaped lengths (the task's recheck variant: longest/median "
        f"{shape['step_max_over_median']:.0f}× per 16 prompts, σ of log length within a prompt "
        f"{shape['within_prompt_log_sd']:.2f}) | {_speedup_and_parity(recheck_r, 'held_out_parity', 'held-out pass@1')} "
        f"(the training reward is not comparable here: a short round trains the responses that finish first, "
        f"mostly those that do not re-derive) "
        f"| [results: reasoning-shaped lengths](docs/results.md#on-reasoning-shaped-lengths), "
        f"`{recheck_r['command']}` at {recheck_r['commit']}; lengths: `{shape['command']}` |",
        f"| GPU acceptance ({gpu['env']['device']}, {gpu['env']['date'][:10]}), end to end | {passed} of "
        f"{len(checks)} checks passed; the program "
        f"{program['speedup_tail_batching_over_baseline']:.2f}× s/step with tail batching "
        f"({program['speedup_after_step_1']:.2f}× after step 1); trainer {trainer['tokens_per_s']:,.0f} tokens/s "
        f"on Qwen2.5-0.5B's shape | [docs/gpu.md](docs/gpu.md), `{GPU_RUN}` |",
        f"| cluster projection, end to end (the real scheduler on modeled H800s; reward, training and weight sync "
        f"costed per step) | every published component on, s/step over the synchronous baseline: {steps} "
        f"| [results: cluster-scale projection](docs/results.md#end-to-end), `{step_r['command']}` at "
        f"{step_r['commit']} |",
        f"| cluster projection, rollout only (the same model) | rollout speedup over the baseline: {sims} "
        f"| [results: cluster-scale projection](docs/results.md#end-to-end), `{sim_r['command']}` at "
        f"{sim_r['commit']} |",
        "| rank 0's control plane (the real coordinator driving N engine servers on this machine) | rank 0's CPU, "
        "as a share of the modeled round: "
        + ", ".join(f"{x['overhead']:.1%} at {x['engines']} engines" for x in control_r["sizes"])
        + " (goal: 2%) | [results: rank 0 at cluster scale](docs/results.md#rank-0-at-cluster-scale-the-control-plane), "
        f"`python -m bench.system.control` at {control_r['commit']} |"])


def control(r: dict[str, Any]) -> str:
    """bench.system.control: rank 0's own CPU per round while it drives N engines, against the modeled round."""
    s = r["settings"]

    def rows(run: dict[str, Any]) -> list[str]:
        return [f"| {x['engines']} | {x['requests_per_round']:,.0f} | {x['modeled_s_per_round']:.1f} s "
                f"| {_mean(x['rounds'], 'replayed_s'):.0f} s | {x['projected_cpu_s_per_round']:.2f} s "
                f"| {_threads(x)} | {x['cpu_us_per_request']:.0f} µs | {x['overhead']:.1%} "
                f"| {x['launch_to_engine_ms']['p50']:,.0f} / {x['launch_to_engine_ms']['p99']:,.0f} ms "
                f"| {x['messages_per_round']:,.0f} ({_messages(x['messages'], len(x['rounds']))}) | {x['messages_per_modeled_s']:,.0f} |"
                for x in run["sizes"]]

    head = ["| engines | requests per round | modeled round | the round as replayed (model time) "
            "| rank 0 CPU per round | of it: coordinator / reward dispatch / ZeroMQ I/O / other threads "
            "| per request "
            "| overhead (÷ modeled round) | launch → engine p50 / p99 "
            "| messages per round | per modeled s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines = [f"{s['model']}, {s['limit'] // 1024}k limit, P0 = 2 × engines, R0 = {s['r0']}, "
             f"{s['responses_per_prompt']} responses launched per prompt (32 requests per engine), {s['rounds']} "
             f"rounds per size{_warmup(s)} replayed at {s['speed']:g}× over {s['hosts']} endpoint host processes; "
             f"{provenance(r)}:", "", *head, *rows(r)]
    if "before" in r:
        lines += ["", f"Before ({r['before']['note']}; {provenance(r['before'])}):", "", *head,
                  *rows(r["before"])]
    lines += ["", "Rank 0 CPU: this process's (scheduler, channel, reward dispatch and their threads), the replay's "
                  "plus its idle wake-ups over the rest of the modeled round at real speed. The round as replayed "
                  "is longer than the model's when rank 0 (or this machine) could not keep up. Messages: rank 0's "
                  "calls to the engines it does not race itself (each with its reply) and the pushes it received. "
                  "Launch → engine: from the round's launch to the request reaching its engine, in wall seconds "
                  "of the replay."]
    return "\n".join(lines)


def _warmup(settings: dict[str, Any]) -> str:
    """Runs that measured their first round, before ``--warmup`` existed, say nothing."""
    n = settings.get("warmup", 0)
    return f" after {n} warm-up round{'s' * (n != 1)} (a fresh process pays its first round's page faults)" if n else ""


def _threads(size: dict[str, Any]) -> str:
    """Rank 0's CPU per round by thread (measured while the round ran, so without the idle projection);
    runs from before the split was recorded show none."""
    t = size.get("thread_cpu_s_per_round")
    if not t:
        return "—"
    main, io = t.get("MainThread", 0.0), t.get("zmq-io", 0.0)
    reward = t.get("reward-dispatcher", 0.0) + t.get("reward-service", 0.0)
    return f"{main:.2f} / {reward:.2f} / {io:.2f} / {sum(t.values()) - main - reward - io:.2f} s"


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(x[key] for x in rows)


def _messages(counts: dict[str, int], rounds: int) -> str:
    """Per round, by kind, most first."""
    return ", ".join(f"{n / rounds:,.0f} {k.strip('_').replace('_serving', '')}"
                     for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {"e2e": e2e, "e2e_recheck": e2e, "rollout": rollout, "rollout_replay": rollout, "race_bias": race_bias,
    "rollout_history": rollout_history, "history_sim": history_sim, "e2e_history": e2e_history,
    "sim": sim, "sim_step": sim_step, "cpu_decode_bound": cpu_decode_bound, "stream": stream, "packing": packing, "logprob": logprob, "attention": attention,
    "engine": engine, "reward": reward, "control": control, "mismatch": mismatch.markdown,
    "mismatch_recheck": mismatch.markdown, "engine_invariance": engine_invariance.markdown}


# blocks drawn from several sources: rendered by a function that reads them itself
SUMMARIES: dict[str, Callable[[], str]] = {"headline": headline}


def render(text: str, where: str = "README.md") -> str:
    def block(match: re.Match) -> str:
        name = match["name"]
        if name in SUMMARIES:
            return f"{match[1]}{SUMMARIES[name]()}\n{match[4]}"
        if name not in RENDERERS:
            raise SystemExit(f"{where}: unknown generated block {name!r}; known: {sorted(RENDERERS)}")
        results = json.loads((RESULTS / f"{name}.json").read_text())
        return f"{match[1]}{RENDERERS[name](results)}\n{match[4]}"

    return BLOCK.sub(block, text)


def pages() -> dict[str, str]:
    """Each page that exists, by its path relative to the repository, with its text."""
    return {str(p.relative_to(REPO)): p.read_text() for p in PAGES if p.exists()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tools.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare, do not write")
    args = p.parse_args(argv)
    stale = []
    for where, text in pages().items():
        new = render(text, where)
        if new == text:
            continue
        stale.append(where)
        if not args.check:
            (REPO / where).write_text(new)
            print(f"{where}: {len(BLOCK.findall(text))} generated block(s) rendered")
    if args.check and stale:
        print(f"{', '.join(stale)}: generated blocks differ from bench/results/*.json; run python -m bench.tools.report",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
