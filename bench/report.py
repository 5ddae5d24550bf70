"""The README's generated tables, rendered from the raw results in ``bench/results/``.

    python -m bench.report           # rewrite every generated block of README.md
    python -m bench.report --check   # exit 1 if a block differs from what its results file gives

A generated block sits between ``<!-- bench.report NAME -->`` and
``<!-- /bench.report -->`` and is produced only from ``bench/results/NAME.json``,
whose command, commit, date and machine it prints; ``tests/test_readme_figures.py``
runs ``--check``, so a figure in such a block cannot drift from its raw result.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from bench.results import REPO

RESULTS = REPO / "bench" / "results"
README = REPO / "README.md"
BLOCK = re.compile(r"(<!-- bench\.report (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench\.report -->)", re.S)


def provenance(r: dict[str, Any]) -> str:
    return f"`{r['command']}` at {r['commit']}, {r['date'][:10]}, {r['machine']}"


def rollout_history(r: dict[str, Any]) -> str:
    """bench_rollout --history: per mode, waste by epoch, amortized speedup and share of the true bound."""
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
    """bench_history: per trace, tail batching with and without history on the modeled cluster."""
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
    """bench.e2e_history: the real program over several epochs, with the paired accuracy statistic."""
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


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "rollout_history": rollout_history, "history_sim": history_sim, "e2e_history": e2e_history}


def render(text: str) -> str:
    def block(match: re.Match) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise SystemExit(f"README.md: unknown generated block {name!r}; known: {sorted(RENDERERS)}")
        results = json.loads((RESULTS / f"{name}.json").read_text())
        return f"{match[1]}{RENDERERS[name](results)}\n{match[4]}"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare, do not write")
    args = p.parse_args(argv)
    text = README.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("README.md: generated blocks differ from bench/results/*.json; run python -m bench.report",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    print(f"README.md: {len(BLOCK.findall(text))} generated block(s) rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
