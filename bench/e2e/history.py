"""History-aware tail batching end to end: the real program over several epochs of a small split.

    python -m bench.e2e.history [--prompts 96] [--epochs 4] [--seeds 0,1,2,3] [--p0 16] [--r0 4]
                                [--out runs/e2e_history] [--results bench/results/e2e_history.json]

Three modes of ``torchrun --nproc_per_node 2 -m rollpacker.train --config
configs/tiny-cpu.yaml`` train the first ``--prompts`` rows of the built-in
training data for ``--epochs`` epochs (epochs x prompts / P0 steps), at each
seed: the synchronous baseline, RollPacker (every component) and RollPacker
with ``scheduler.history`` on. Same seed, same data order and sampling seeds
in every mode. Each run is one ``torchrun`` process over all its epochs, so
a round's timing never depends on where a process starts: only step 1
(engine and reward-pool start, the same short round in every mode because
the history is empty in epoch 0) is left out of the timings. The runs go seed
by seed, the modes' order alternating from one seed to the next, so every
mode sees the same load on shared cores.

Per epoch (a step's seconds and tokens are split between epochs by the share
of its trained prompts, read from the run's ``ledger.jsonl``): the wasted-token
fraction, rollout and end-to-end seconds per trained prompt and the speedup
over the baseline; over the run: the speedup per seed and its geometric mean,
the Amdahl ceiling (baseline step / baseline train seconds: the speedup if
rollout cost nothing), and accuracy parity as a paired difference over seeds
(mode minus baseline at the same seed, mean and 95% t-interval) of the mean
reward over the last epoch and of the final policies' held-out pass@1.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.e2e import ablation as e2e
from bench.e2e import stats as rep
from bench.tools.results import write_results

HISTORY = "history"
MODES = [rep.MODES[0], next(m for m in rep.MODES if m.key == rep.ROLLPACKER),
         rep.Mode(HISTORY, "RollPacker + history", {**next(m for m in rep.MODES if m.key == rep.ROLLPACKER).overrides,
                                                    "scheduler.history.enabled": "true"})]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.history", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=96, help="training rows (the split's size)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--p0", type=int, default=16)
    p.add_argument("--r0", type=int, default=4)
    p.add_argument("--out", default="runs/e2e_history")
    p.add_argument("--results", default="bench/results/e2e_history.json", help="raw results (tracked)")
    p.add_argument("--eval-n", type=int, default=4, help="held-out responses per eval prompt (0: skip)")
    p.add_argument("--chunk-timeout", type=float, default=3600.0)
    p.add_argument("--report-only", action="store_true", help="re-read the runs in --out, run nothing")
    args = p.parse_args(argv)
    args.seed_list = [int(s) for s in args.seeds.split(",")]
    if args.prompts % args.p0:
        p.error(f"--prompts {args.prompts} must be a multiple of --p0 {args.p0} (whole steps per epoch)")
    return args


def split_file(args: argparse.Namespace) -> Path:
    from rollpacker.config import load_config

    source = e2e.REPO / load_config(e2e.REPO / e2e.CONFIG).data.train_files[0]
    lines = source.read_text().splitlines(keepends=True)[:args.prompts]
    path = Path(args.out).resolve() / f"train-{args.prompts}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


def run_all(args: argparse.Namespace, split: Path) -> dict[str, Any]:
    steps = args.epochs * args.prompts // args.p0
    manifest: dict[str, Any] = {}
    for k, seed in enumerate(args.seed_list):
        for mode in MODES if k % 2 == 0 else MODES[::-1]:
            name = f"{mode.key}-s{seed}"
            e2e.clear_run(Path(args.out), name)
            split_mode = rep.Mode(mode.key, mode.label, {**mode.overrides, "data.train_files": f"[{split}]"})
            wall = e2e.run_chunk(args, name, split_mode, seed, steps)
            manifest[name] = {"mode": mode.key, "seed": seed, "warm_steps": [1], "wall_s": wall}
            print(f"  {name:<16} {steps} steps {wall:7.1f} s wall", flush=True)
    (Path(args.out) / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def epoch_table(records: list[dict[str, Any]], ledger: list[dict[str, Any]], warm: set[int]) -> dict[int, dict]:
    """Per epoch of trained prompts: seconds (warm steps left out, per prompt), tokens and waste."""
    epochs_of = {rec["step"]: [e for _, e in rec["trained"] + rec["filtered"]] for rec in ledger}
    timed = [(epochs_of[r["step"]], {"step_s": rep.step_seconds(r), "rollout_s": r["time/rollout_s"],
                                     "train_s": r["time/train_s"]}) for r in records if r["step"] not in warm]
    tokens = [(epochs_of[r["step"]], {"generated_tokens": r["generated_tokens"], "wasted_tokens": r["wasted_tokens"]})
              for r in records]
    out = {}
    for epoch, row in rep.by_epoch(tokens).items():
        t = rep.by_epoch(timed).get(epoch)
        out[epoch] = {"trained": row["trained"], "generated_tokens": row["generated_tokens"],
                      "wasted_fraction": row["wasted_tokens"] / max(1.0, row["generated_tokens"]),
                      **({f"{k}_per_prompt": t[k] / t["trained"] for k in ("step_s", "rollout_s", "train_s")}
                         if t else {})}
    return out


def summarize(args: argparse.Namespace, manifest: dict[str, Any]) -> dict[str, Any]:
    out = Path(args.out)
    runs: dict[str, Any] = {}
    for name, info in manifest.items():
        records = e2e.load_metrics(out / name / "metrics.jsonl")
        ledger = [json.loads(ln) for ln in (out / name / "ledger.jsonl").read_text().splitlines() if ln]
        warm = set(info["warm_steps"])
        last_epoch = [r for r in records if r["step"] > (args.epochs - 1) * args.prompts // args.p0]
        runs[name] = {**info, "summary": rep.mode_summary(records, warm),
                      "epochs": epoch_table(records, ledger, warm),
                      "reward_last_epoch": statistics.fmean(r["reward_mean"] for r in last_epoch)}
    if args.eval_n:
        for name, result in e2e.held_out_runs(out, list(runs), args.eval_n).items():
            runs[name]["held_out"] = result["pass_at_1"]
    report: dict[str, Any] = {"runs": runs, "modes": {}}
    for mode in MODES:
        by_seed = {s: runs[f"{mode.key}-s{s}"] for s in args.seed_list}
        base = {s: runs[f"{MODES[0].key}-s{s}"] for s in args.seed_list}
        speedups = {s: rep.speedup(base[s]["summary"], r["summary"]) for s, r in by_seed.items()}
        report["modes"][mode.key] = {
            "label": mode.label, "speedup_per_seed": speedups,
            "speedup_geomean": math.exp(statistics.fmean(map(math.log, speedups.values()))),
            "wasted_fraction_per_epoch": {e: statistics.fmean(r["epochs"][e]["wasted_fraction"] for r in by_seed.values())
                                          for e in range(args.epochs)},
            "reward_parity": rep.paired_difference({s: base[s]["reward_last_epoch"] for s in base},
                                                   {s: r["reward_last_epoch"] for s, r in by_seed.items()}),
            **({"held_out_parity": rep.paired_difference({s: base[s]["held_out"] for s in base},
                                                         {s: r["held_out"] for s, r in by_seed.items()})}
               if args.eval_n else {}),
        }
    base_summaries = [runs[f"{MODES[0].key}-s{s}"]["summary"] for s in args.seed_list]
    report["amdahl_ceiling"] = statistics.fmean(b["step_s"] / b["train_s"] for b in base_summaries)
    return report


def print_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    runs = report["runs"]
    print(f"\nPer epoch, mean over seeds {args.seed_list} (s per trained prompt; speedup = baseline s / mode s):")
    print(f"{'epoch':>5} {'mode':<24}{'wasted':>8}{'rollout s':>11}{'step s':>9}{'speedup':>9}")
    for epoch in range(args.epochs):
        for mode in MODES:
            rows = [runs[f"{mode.key}-s{s}"]["epochs"].get(epoch, {}) for s in args.seed_list]
            base = [runs[f"{MODES[0].key}-s{s}"]["epochs"].get(epoch, {}) for s in args.seed_list]
            if not all("step_s_per_prompt" in r for r in rows + base):
                continue
            step = statistics.fmean(r["step_s_per_prompt"] for r in rows)
            print(f"{epoch:>5} {mode.label:<24}{statistics.fmean(r['wasted_fraction'] for r in rows):>8.0%}"
                  f"{statistics.fmean(r['rollout_s_per_prompt'] for r in rows):>11.3f}{step:>9.3f}"
                  f"{statistics.fmean(r['step_s_per_prompt'] for r in base) / step:>8.2f}x")
    print(f"\nAmdahl ceiling (baseline step s / baseline train s, the speedup if rollout cost nothing): "
          f"{report['amdahl_ceiling']:.2f}x")
    for key, m in report["modes"].items():
        if key == MODES[0].key:
            continue
        print(f"{m['label']}: speedup per seed " + ", ".join(f"{x:.2f}x" for x in m["speedup_per_seed"].values())
              + f" (geometric mean {m['speedup_geomean']:.2f}x)")
        print("  " + rep.paired_text(m["reward_parity"], "mean reward over the last epoch"))
        if "held_out_parity" in m:
            print("  " + rep.paired_text(m["held_out_parity"], "held-out pass@1 of the final policy"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    split = split_file(args)
    if args.report_only:
        manifest = json.loads((Path(args.out) / "manifest.json").read_text())
    else:
        print(f"{len(MODES)} modes x {len(args.seed_list)} seeds, {args.epochs} epochs of {args.prompts} prompts "
              f"({args.epochs * args.prompts // args.p0} steps), P0={args.p0}, R0={args.r0}, into {args.out}/",
              flush=True)
        manifest = run_all(args, split)
    report = summarize(args, manifest)
    print_report(args, report)
    path = write_results(args.results, {"settings": vars(args), **report})
    print(f"raw results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
