"""History-aware tail batching in simulation: how much a prompt's past length buys, by how well it predicts.

    python -m bench.system.history [--seeds 1] [--epochs 4] [--num-prompts 512] [--p0 64]
                                  [--history-margin M] [--eta-p-seen E] [--eta-r-seen E]
                                  [--cases flat spearman-0.9 ...] [--json]

Over multi-epoch traces (``rollpacker.sim.traces.multi_epoch_trace``) the
real scheduler runs three modes until every prompt has been trained once in
each epoch (``rollpacker.sim.epochs``): the synchronous baseline, tail
batching, and tail batching with history. The traces differ only in how well
a prompt's mean response length in one epoch ranks it in the next (the
realized Spearman correlation; rho calibrated by bisection per seed):

- flat: every prompt has the same median (sigma_prompt 0, the response noise
  raised to sigma 1.03 so the spread of single responses is the long-tail
  model's); history has nothing to learn.
- spearman-0.9 / -0.6 / -0.3: the long-tail model with a per-prompt median
  that moves between epochs.
- drift: spearman-0.9 with lengths growing 16% per epoch (log drift 0.15),
  as RL training lengthens responses.

Printed per case and epoch: the wasted share of generated tokens of each
tail-batching mode, the speedup of each over the baseline (rollout seconds
of the same prompts) and the ratio with/without history (> 1: history
helps), with how many prompts history routed straight to the long queue.
Figures are means over seeds. Raw per-seed figures, the command line and the
commit go to ``--out`` (default bench/results/history_sim.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from typing import Any

from bench.tools.results import REPO, write_results
from rollpacker.scheduler.config import HistoryConfig
from rollpacker.sim.epochs import EpochRun, compare, run_epochs
from rollpacker.sim.run import SimSettings
from rollpacker.sim.traces import calibrate_rho, epoch_spearman, multi_epoch_trace

LONGTAIL = {"sigma_prompt": 0.8, "sigma_response": 0.65}
FLAT = {"sigma_prompt": 0.0, "sigma_response": math.hypot(0.8, 0.65)}
CASES = [  # name, length model, target realized Spearman (None: rho = 1), log drift per epoch
    ("flat", FLAT, None, 0.0),
    ("spearman-0.9", LONGTAIL, 0.9, 0.0),
    ("spearman-0.6", LONGTAIL, 0.6, 0.0),
    ("spearman-0.3", LONGTAIL, 0.3, 0.0),
    ("drift", LONGTAIL, 0.9, 0.15),
]
MODES = ("baseline", "tail", "tail_history")


def parse_args() -> argparse.Namespace:
    d, h = SimSettings(), HistoryConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model, choices=["7b", "14b", "32b"])
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--tp", type=int, default=d.tp)
    p.add_argument("--limit", type=int, default=d.limit, help="max response length; the median is limit / 28")
    p.add_argument("--p0", type=int, default=64)
    p.add_argument("--r0", type=int, default=d.r0)
    p.add_argument("--eta", type=float, default=d.eta_p, help="eta_p = eta_r for unseen prompts")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=10, help="trace samples per prompt and epoch")
    p.add_argument("--seeds", type=int, default=1, help="seeds to average over (trace, shuffle, regeneration)")
    p.add_argument("--history-margin", type=float, default=h.margin)
    p.add_argument("--eta-p-seen", type=float, default=h.eta_p_seen)
    p.add_argument("--eta-r-seen", type=float, default=h.eta_r_seen)
    p.add_argument("--cases", nargs="+", choices=[c[0] for c in CASES], metavar="CASE",
                   help=f"subset of {[c[0] for c in CASES]}")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "history_sim.json"),
                   help="raw results (JSON); '' to skip")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    return p.parse_args()


def run_case(args: argparse.Namespace, history: HistoryConfig, name: str, model: dict[str, float],
             target: float | None, drift: float) -> dict[str, Any]:
    trace_kw = dict(samples=args.samples, median=args.limit / 28, limit=args.limit, drift=drift, **model)
    seeds = []
    for seed in range(args.seeds):
        rho = 1.0 if target is None else calibrate_rho(target, args.num_prompts, args.epochs, seed=seed, **trace_kw)
        trace = multi_epoch_trace(args.num_prompts, args.epochs, rho=rho, seed=seed, **trace_kw)
        settings = SimSettings(model=args.model, gpus=args.gpus, tp=args.tp, p0=args.p0, r0=args.r0,
                               eta_p=args.eta, eta_r=args.eta, limit=args.limit, seed=seed)
        runs = {"baseline": run_epochs("baseline", settings, trace, args.epochs, shuffle_seed=seed),
                "tail": run_epochs("tail_batching", settings, trace, args.epochs, shuffle_seed=seed),
                "tail_history": run_epochs("tail_batching", settings, trace, args.epochs, history=history,
                                           shuffle_seed=seed)}
        seeds.append({"seed": seed, "rho": rho, "realized_spearman": epoch_spearman(trace), **figures(runs),
                      "runs": {mode: run.as_dict() for mode, run in runs.items()}})
    return {"case": name, "target_spearman": target, "drift": drift, "length_model": model,
            "mean": {key: mean_of([s[key] for s in seeds]) for key in ("rho", "realized_spearman", "per_epoch",
                                                                        "total", "routed", "same_prompts")},
            "seeds": seeds}


def figures(runs: dict[str, EpochRun]) -> dict[str, Any]:
    """The compared figures of one seed: per epoch and in total, each mode's wasted
    share, the speedups over the baseline, and history's gain over plain tail batching."""
    plain, hist = compare(runs["baseline"], runs["tail"]), compare(runs["baseline"], runs["tail_history"])

    def row(p: dict, h: dict) -> dict[str, float]:
        return {"wasted_tail": p["tail_batching"]["wasted_token_fraction"],
                "wasted_tail_history": h["tail_batching"]["wasted_token_fraction"],
                "seconds_baseline": p["baseline"]["rollout_seconds"],
                "seconds_tail": p["tail_batching"]["rollout_seconds"],
                "seconds_tail_history": h["tail_batching"]["rollout_seconds"],
                "speedup_tail": p["speedup"], "speedup_tail_history": h["speedup"],
                "history_over_tail": h["speedup"] / p["speedup"] if p["speedup"] else 0.0}

    return {"per_epoch": [row(p, h) for p, h in zip(plain["per_epoch"], hist["per_epoch"])],
            "total": row(plain["total"], hist["total"]), "routed": hist["routed"],
            "same_prompts": plain["same_prompts"] and hist["same_prompts"]}


def mean_of(values: list[Any]) -> Any:
    """Element-wise mean over seeds of numbers, dicts and lists of them; booleans must all hold."""
    first = values[0]
    if isinstance(first, bool):
        return all(values)
    if isinstance(first, dict):
        return {k: mean_of([v[k] for v in values]) for k in first}
    if isinstance(first, list):
        return [mean_of(list(items)) for items in zip(*values)]
    return statistics.fmean(values)


def print_table(results: dict[str, Any]) -> None:
    s = results["settings"]
    print(f"Qwen2.5-{s['model'].upper()} on {s['gpus']} x H800 TP {s['tp']}, P0={s['p0']} R0={s['r0']} "
          f"eta {s['eta']}, limit {s['limit']}, {s['num_prompts']} prompts x {s['epochs']} epochs, "
          f"{s['seeds']} seed(s)")
    print("history: " + ", ".join(f"{k} {v}" for k, v in results["history"].items() if k != "enabled"))
    print(f"{'case':<14}{'rho':>6}{'rs':>6} {'epoch':<6}{'wasted t/h':>13}{'speedup t/h':>14}{'h/t':>7}"
          f"{'routed':>8}")
    for case in results["cases"]:
        m = case["mean"]
        rows = [(str(e), r) for e, r in enumerate(m["per_epoch"])] + [("total", m["total"])]
        for i, (epoch, r) in enumerate(rows):
            head = f"{case['case']:<14}{m['rho']:>6.3f}{m['realized_spearman']:>6.2f}" if i == 0 else " " * 26
            print(f"{head} {epoch:<6}{r['wasted_tail']:>6.1%}/{r['wasted_tail_history']:<6.1%}"
                  f"{r['speedup_tail']:>7.2f}/{r['speedup_tail_history']:<6.2f}{r['history_over_tail']:>7.3f}"
                  + (f"{m['routed']:>8.0f}" if epoch == "total" else ""))
        if not m["same_prompts"]:
            print(f"{'':<14}WARNING: the modes did not train the same prompts")
    print(f"wasted/speedup t/h: tail batching without/with history; h/t: history's speedup over plain tail "
          f"batching; rs: realized epoch-to-epoch Spearman; {results['wall_seconds']:.0f} s")


def main() -> None:
    args = parse_args()
    history = HistoryConfig(enabled=True, margin=args.history_margin, eta_p_seen=args.eta_p_seen,
                            eta_r_seen=args.eta_r_seen)
    history.validate()
    start = time.monotonic()
    cases = [run_case(args, history, *case) for case in CASES if not args.cases or case[0] in args.cases]
    results = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "json")},
               "history": dataclasses.asdict(history),
               "wall_seconds": time.monotonic() - start, "cases": cases}
    if args.out:
        results = {**json.loads(write_results(args.out, results).read_text())}
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
