"""The engine-trainer mismatch made real on CPU, measured, and corrected: the built-in example with a
bf16 reference engine against the fp32 trainer, with and without importance-sampling correction.

    python -m bench.e2e.mismatch [--seeds 1,2,3,4] [--arms fp32,bf16,bf16_tis] [--out /tmp/mismatch] \
        [--results bench/results/mismatch.json] [--plot docs/mismatch.png] [-- extra overrides]

Each arm is the example's recipe (``configs/tiny-cpu.yaml``, tail batching) with the overrides of
``ARMS``; each seed runs every arm (``bench.e2e.example_recipe``'s runner: ``run.seed``, ``data.seed``
and ``rollout.seed`` set to the seed), so arms compare paired by seed.

Writes ``--results``: the commands, commit, per-run curves (held-out pass@1 every 5 steps, and per
step the training reward, the grad norm, the round kind and every ``mismatch/`` diagnostic), and:
* the size of the gap per arm, per round kind and per response-length bucket (means over steps and
  seeds), and whether long rounds' gap is larger than short rounds' (paired by seed);
* each arm against ``bf16`` (no correction) and ``fp32`` at the last step: held-out pass@1 (greedy
  and temperature 1), mean training reward over the last 5 steps and mean grad norm, each the
  paired difference over seeds with its 95% t-interval.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.e2e import example_recipe
from bench.e2e.stats import paired_difference
from bench.tools.results import write_results

BF16 = ["rollout.dtype=bf16"]
ARMS = {
    "fp32": ["rollout.dtype=fp32"],
    "bf16": BF16,
    "bf16_tis": [*BF16, "trainer.mismatch.correct=token", "trainer.mismatch.mode=truncate"],
}
GAP = ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "ppl_ratio", "tokens_above", "tokens_below", "seqs_above",
       "seqs_below")
LAST_STEPS = 5


def per_step(metrics: Path) -> list[dict]:
    """The training lines of a run: step, round kind, reward, grad norm and the mismatch diagnostics."""
    out = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "round" in row:
            out.append({"step": row["step"], "round": row["round"], "reward_mean": row["reward_mean"],
                        "grad_norm": row["train/grad_norm"], "logprob_mismatch": row["train/logprob_mismatch"],
                        **{k: v for k, v in row.items() if k.startswith("mismatch/") and k.count("/") < 3
                           and not k.startswith(("mismatch/short/", "mismatch/long/"))}})
    return out


def gap_size(runs: list[dict]) -> dict:
    """Mean of each diagnostic over steps and seeds, overall and per round kind and length bucket."""
    def mean(rows: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return statistics.fmean(vals) if vals else None

    steps = [s for r in runs for s in r["steps"]]
    buckets = sorted({k.split("/")[1] for s in steps for k in s if k.startswith("mismatch/len_")},
                     key=lambda b: int(b.split("_")[1]))
    return {
        "all": {k: mean(steps, f"mismatch/{k}") for k in GAP},
        "by_round": {kind: {k: mean([s for s in steps if s["round"] == kind], f"mismatch/{k}") for k in GAP}
                     for kind in ("short", "long")},
        "by_length": {b: {k: mean(steps, f"mismatch/{b}/{k}") for k in ("kl_k3", "chi2_token", "chi2_seq", "tokens")}
                      for b in buckets},
        "long_minus_short_kl_k3": paired_difference(*[
            {r["seed"]: mean([s for s in r["steps"] if s["round"] == kind], "mismatch/kl_k3") for r in runs}
            for kind in ("short", "long")]),
    }


def outcome(run: dict) -> dict[str, float]:
    tail = run["steps"][-LAST_STEPS:]
    return {"t1_pass@1": run["t1_end"], "greedy_pass@1": run["greedy_end"],
            f"reward_last_{LAST_STEPS}": statistics.fmean(s["reward_mean"] for s in tail),
            "grad_norm_mean": statistics.fmean(s["grad_norm"] for s in run["steps"])}


def compare(by_arm: dict[str, list[dict]], base: str) -> dict:
    """Every arm minus ``base``, paired by seed, on each outcome."""
    ref = {r["seed"]: outcome(r) for r in by_arm[base]}
    out = {}
    for arm, runs in by_arm.items():
        if arm != base:
            mine = {r["seed"]: outcome(r) for r in runs}
            out[arm] = {k: paired_difference({s: v[k] for s, v in ref.items()}, {s: v[k] for s, v in mine.items()})
                        for k in next(iter(ref.values()))}
    return out


COLORS = {"fp32": "tab:gray", "bf16": "tab:blue", "bf16_tis": "tab:orange"}


def plot(by_arm: dict[str, list[dict]], path: Path, config: str, results: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    colors = COLORS
    for arm, runs in by_arm.items():
        evals = [p["step"] for p in runs[0]["curve"]]
        axes[0].plot(evals, [statistics.fmean(r["curve"][i]["t1_pass@1"] for r in runs) for i in range(len(evals))],
                     marker="o", color=colors[arm], label=f"{arm} ({len(runs)} seeds)")
        steps = [s["step"] for s in runs[0]["steps"]]
        axes[1].plot(steps, [statistics.fmean(r["steps"][i]["reward_mean"] for r in runs) for i in range(len(steps))],
                     color=colors[arm], label=arm)
        for kind, marker in (("short", "."), ("long", "^")):
            pts = [(s["step"], s["mismatch/kl_k3"]) for r in runs for s in r["steps"]
                   if s["round"] == kind and s.get("mismatch/kl_k3", 0) > 0]
            if pts:
                axes[2].scatter(*zip(*pts), s=14, marker=marker, color=colors[arm], alpha=0.6,
                                label=f"{arm}, {kind} rounds")
    axes[0].set(title="held-out pass@1, temperature 1", xlabel="training step", ylim=(0, 1))
    axes[1].set(title="training reward (mean over seeds)", xlabel="training step")
    axes[2].set(title="KL(rollout || trainer), k3, per step", xlabel="training step", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{config}: reference engine in {' or '.join(a for a in ('fp32', 'bf16') if a in by_arm)}, "
                 f"trainer in fp32 ({results})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2e}" if x and abs(x) < 1e-3 else f"{x:.4f}"


def markdown(r: dict) -> str:
    """The results file as docs/mismatch.md's tables (rendered by ``python -m bench.tools.report``)."""
    seeds = sorted({run["seed"] for run in r["runs"]})
    lines = [f"`{r['command']}` at {r['commit']}, {r['date'][:10]}, {r['machine']}, load average "
             f"{', '.join(f'{x:.1f}' for x in r['load_average'])} at the end; seeds {', '.join(map(str, seeds))}."
             + (f" {r['dirty_note']}" if "dirty_note" in r else ""), "",
             "The gap, mean over every step of every seed (KL in nats per token):", "",
             "| arm | round | kl_k1 | kl_k3 | chi2_token | chi2_seq | ppl_ratio | tokens above `high` | tokens below 1/`high` |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, g in r["gap"].items():
        for kind, row in (("all", g["all"]), *g["by_round"].items()):
            lines.append(f"| {arm} | {kind} | " + " | ".join(_f(row[k]) for k in ("kl_k1", "kl_k3", "chi2_token", "chi2_seq"))
                         + f" | {row['ppl_ratio']:.6f} | " + " | ".join(_f(row[k]) for k in ("tokens_above", "tokens_below"))
                         + " |")
    lines += ["", "By response length (tokens), kl_k3 / chi2_seq:", "",
              "| arm | " + " | ".join(next(iter(r["gap"].values()))["by_length"]) + " |",
              "|---|" + "---|" * len(next(iter(r["gap"].values()))["by_length"])]
    for arm, g in r["gap"].items():
        lines.append(f"| {arm} | " + " | ".join(f"{_f(b['kl_k3'])} / {_f(b['chi2_seq'])}"
                                              for b in g["by_length"].values()) + " |")
    lines += ["", "Long rounds' kl_k3 minus short rounds', paired by seed (95% t-interval):", ""]
    for arm, g in r["gap"].items():
        d = g["long_minus_short_kl_k3"]
        which = ("no difference (the interval contains 0)" if d["low"] <= 0 <= d["high"]
                 else "long rounds' gap larger" if d["low"] > 0 else "long rounds' gap smaller")
        lines.append(f"- {arm}: {_f(d['mean'])} [{_f(d['low'])}, {_f(d['high'])}]: {which}")
    pairs = [(arm, base, what) for arm, base, what in (
        ("bf16", "fp32", "what the bf16 engine changes (its evaluation runs in bf16 too)"),
        ("bf16_tis", "bf16", "what the correction changes")) if arm in r.get(f"against_{base}", {})]
    if pairs:
        keys = list(r[f"against_{pairs[0][1]}"][pairs[0][0]])
        lines += ["", "Paired by seed, mean difference [95% t-interval] at the last step (pass@1), over the last "
                  f"{LAST_STEPS} steps (reward) and over all steps (grad norm):", "",
                  "| difference | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for arm, base, what in pairs:
            row = r[f"against_{base}"][arm]
            lines.append(f"| {arm} − {base}: {what} | " + " | ".join(
                f"{row[k]['mean']:+.3f} [{row[k]['low']:+.3f}, {row[k]['high']:+.3f}]" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--seeds", default="1,2,3,4")
    p.add_argument("--arms", default="fp32,bf16,bf16_tis")
    p.add_argument("--out", default="/tmp/mismatch")
    p.add_argument("--results", default="bench/results/mismatch.json")
    p.add_argument("--plot", default=None)
    p.add_argument("--replot", action="store_true", help="only draw --plot from the existing --results file")
    p.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = p.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.results).read_text())
        runs = {a: [r for r in saved["runs"] if r["arm"] == a] for a in saved["arms"]}
        plot(runs, Path(args.plot), saved["config"], args.results)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - ARMS.keys()
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    by_arm: dict[str, list[dict]] = {a: [] for a in arms}
    for seed in seeds:
        for arm in arms:
            runner = argparse.Namespace(config=args.config, tag=f"{arm}-", overrides=[*ARMS[arm], *args.overrides])
            run = example_recipe.run_one(runner, "tail_batching", seed, out)
            run.update(arm=arm, steps=per_step(out / f"{arm}-tail_batching-s{seed}" / "metrics.jsonl"))
            by_arm[arm].append(run)
    result = {
        "what": "the built-in example with the reference engine in fp32 or bf16 against the fp32 trainer, "
                "with and without importance-sampling correction: the gap's size and the training outcome",
        "config": args.config, "arms": {a: ARMS[a] for a in arms}, "overrides": args.overrides,
        "gap": {a: gap_size(runs) for a, runs in by_arm.items()},
        "against_bf16": compare(by_arm, "bf16") if "bf16" in by_arm else {},
        "against_fp32": compare(by_arm, "fp32") if "fp32" in by_arm else {},
        "runs": [r for runs in by_arm.values() for r in runs],
    }
    write_results(args.results, result)
    for arm, g in result["gap"].items():
        by_round = g["by_round"]
        print(f"{arm}: kl_k3 {g['all']['kl_k3']:.3g} (short {by_round['short']['kl_k3']}, long "
              f"{by_round['long']['kl_k3']}), chi2_token {g['all']['chi2_token']:.3g}, chi2_seq "
              f"{g['all']['chi2_seq']:.3g}, tokens above {g['all']['tokens_above']:.3g}")
    for base in ("bf16", "fp32"):
        for arm, cmp in result[f"against_{base}"].items():
            for key, c in cmp.items():
                print(f"{arm} - {base}, {key}: {c['mean']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] ({c['verdict']})")
    print(f"written to {args.results}")
    if args.plot:
        plot(by_arm, Path(args.plot), args.config, args.results)
        print(f"drawn to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
