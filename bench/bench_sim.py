"""Simulated rollout time at the published settings, beside the published numbers.

    python -m bench.bench_sim [--rounds 10] [--seeds 1] [--planner] [--json]

For Qwen2.5-7B/14B/32B at 8k/16k/32k on 16/32/64 H800 (P0=128, R0=8, rollout
TP 1/2/2, eta 1.25) the real scheduler runs baseline and tail batching over
the modeled engines (``rollpacker.sim``) for two full 4-short + 1-long cycles,
and the table shows the mean rollout seconds per step beside the published
ones (NSDI'26: 8k 82 -> 47 s, 16k 277 -> 88 s, 32k 673 -> 170 s) and the ratio
of the predicted to the published speedup.

Length model: the parametric long-tail model of ``rollpacker.sim.traces``
(per-prompt log-normal median, sigma 0.8, x per-response log-normal noise,
sigma 0.65; median = limit / 28, so the longest response of a 1024-response
step is ~25-32x the median and reaches the limit, as published).
"""
from __future__ import annotations

import argparse
import json
import statistics

from rollpacker.sim.run import SimSettings, run_mode, summarize
from rollpacker.sim.traces import longtail_trace

PUBLISHED = [  # model, limit, GPUs, rollout TP, baseline s, tail batching s
    ("7b", 8192, 16, 1, 82.0, 47.0),
    ("14b", 16384, 32, 2, 277.0, 88.0),
    ("32b", 32768, 64, 2, 673.0, 170.0),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10, help="rounds per mode (10 = two cycles)")
    p.add_argument("--seeds", type=int, default=1, help="length-model seeds to average over")
    p.add_argument("--planner", action="store_true", help="tail batching with the parallelism planner")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    for model, limit, gpus, tp, pub_base, pub_tail in PUBLISHED:
        summaries = []
        for seed in range(args.seeds):
            settings = SimSettings(model=model, gpus=gpus, tp=tp, limit=limit, rounds=args.rounds,
                                   planner=args.planner, seed=seed)
            trace = longtail_trace(2048, samples=10, median=limit / 28, limit=limit, seed=seed)
            summaries.append(summarize(run_mode("baseline", settings, trace), run_mode("tail_batching", settings, trace)))
        mean = {k: statistics.fmean(s[k] for s in summaries) for k in summaries[0]}
        pub_speedup = pub_base / pub_tail
        rows.append({"model": model, "limit": limit, "gpus": gpus, "tp": tp, "published_baseline_s": pub_base,
                     "published_tail_s": pub_tail, "published_speedup": pub_speedup, **mean,
                     "speedup_ratio": mean["speedup"] / pub_speedup})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'model':<6}{'limit':>6}{'GPUs':>5}{'TP':>3} | {'published s':>13}{'x':>6} | {'simulated s':>13}"
          f"{'x':>6}{'short/long s':>14}{'bubble b/t':>11}{'max/med':>8} | {'sim x / pub x':>13}")
    for r in rows:
        print(f"{r['model']:<6}{r['limit']:>6}{r['gpus']:>5}{r['tp']:>3} | "
              f"{r['published_baseline_s']:>6.0f}->{r['published_tail_s']:<5.0f}{r['published_speedup']:>6.2f} | "
              f"{r['baseline_mean_s']:>6.0f}->{r['tail_mean_s']:<5.0f}{r['speedup']:>6.2f}"
              f"{r['short_mean_s']:>7.0f}/{r['long_mean_s']:<6.0f}"
              f"{r['baseline_bubble']:>6.2f}/{r['tail_bubble']:<4.2f}{r['baseline_max_over_median']:>8.1f} | "
              f"{r['speedup_ratio']:>13.2f}")
    print(f"length model: log-normal, median = limit/28, sigma 0.8 per prompt x 0.65 per response; "
          f"{args.rounds} rounds per mode, {args.seeds} seed(s){', planner on' if args.planner else ''}")


if __name__ == "__main__":
    main()
