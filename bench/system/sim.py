"""Simulated rollout time at the published settings, beside the published numbers.

    python -m bench.system.sim [--rounds 10] [--seeds 1] [--out bench/results/sim.json]

For Qwen2.5-7B/14B/32B at 8k/16k/32k on 16/32/64 H800 (P0=128, R0=8, rollout
TP 1/2/2, eta 1.25) the real scheduler runs the baseline, tail batching and
tail batching with the parallelism planner over the modeled engines
(``rollpacker.sim``) for two full 4-short + 1-long cycles on the same trace.
The raw results (every round of every mode, per seed) go to ``--out``, from
which ``python -m bench.tools.report`` renders the table in docs/results.md: the mean rollout
seconds per step beside the published ones (NSDI'26: 8k 82 -> 47 s, 16k 277 ->
88 s, 32k 673 -> 170 s) and the ratio of the predicted to the published speedup.

Length model: the parametric long-tail model of ``rollpacker.sim.traces``
(per-prompt log-normal median, sigma 0.8, x per-response log-normal noise,
sigma 0.65; median = limit / 28, so the longest response of a 1024-response
step is ~25-32x the median and reaches the limit, as published).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from bench.e2e.stats import PUBLISHED_ABLATION, ROLLPACKER
from bench.tools.report import sim as render
from bench.tools.results import REPO, write_results
from rollpacker.sim.run import SimSettings, row_dict, run_mode, summarize
from rollpacker.sim.traces import PromptLengths, longtail_trace

PUBLISHED = [  # model, limit, GPUs, rollout TP, baseline s, tail batching s; end to end: stats.PUBLISHED_ABLATION
    ("7b", 8192, 16, 1, 82.0, 47.0),
    ("14b", 16384, 32, 2, 277.0, 88.0),
    ("32b", 32768, 64, 2, 673.0, 170.0),
]
TRACE = {"prompts": 2048, "samples": 10, "median_divisor": 28, "sigma_prompt": 0.8, "sigma_response": 0.65}


def published_trace(limit: int, seed: int) -> list[PromptLengths]:
    """The long-tail model's lengths (``TRACE``) for a response limit: the published shape."""
    return longtail_trace(TRACE["prompts"], samples=TRACE["samples"], median=limit / TRACE["median_divisor"],
                          limit=limit, sigma_prompt=TRACE["sigma_prompt"], sigma_response=TRACE["sigma_response"],
                          seed=seed)


def run_seed(settings: SimSettings) -> dict:
    """One seed of one model: the three modes on one trace, each round's stats and the summaries."""
    trace = published_trace(settings.limit, settings.seed)
    rounds = {"baseline": run_mode("baseline", settings, trace),
              "tail_batching": run_mode("tail_batching", settings, trace),
              "planner": run_mode("tail_batching", dataclasses.replace(settings, planner=True), trace)}
    return {"seed": settings.seed, "tail_batching": summarize(rounds["baseline"], rounds["tail_batching"]),
            "planner": summarize(rounds["baseline"], rounds["planner"]),
            "rounds": {mode: [row_dict(r) for r in rows] for mode, rows in rounds.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10, help="rounds per mode (10 = two cycles)")
    p.add_argument("--seeds", type=int, default=1, help="length-model seeds to average over")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "sim.json"), help="raw results (JSON)")
    args = p.parse_args()
    rows = []
    for i, (model, limit, gpus, tp, pub_base, pub_tail) in enumerate(PUBLISHED):
        runs = [run_seed(SimSettings(model=model, gpus=gpus, tp=tp, limit=limit, rounds=args.rounds, seed=seed))
                for seed in range(args.seeds)]
        mean = {mode: {k: statistics.fmean(run[mode][k] for run in runs) for k in runs[0][mode]}
                for mode in ("tail_batching", "planner")}
        rows.append({"model": model, "limit": limit, "gpus": gpus, "tp": tp,
                     "published": {"baseline_s": pub_base, "tail_s": pub_tail, "speedup": pub_base / pub_tail,
                                   "e2e_tail_batching": PUBLISHED_ABLATION["tail_batching"][i],
                                   "e2e_all": PUBLISHED_ABLATION[ROLLPACKER][i]},
                     "mean": mean, "speedup_ratio": mean["tail_batching"]["speedup"] * pub_tail / pub_base,
                     "seeds": runs})
    d = SimSettings()
    settings = {"rounds": args.rounds, "seeds": args.seeds, "p0": d.p0, "r0": d.r0, "eta_p": d.eta_p,
                "eta_r": d.eta_r, "trace": TRACE}
    results = json.loads(write_results(args.out, {"settings": settings, "models": rows}).read_text())
    print(render(results))
    print(f"raw results: {args.out}")


if __name__ == "__main__":
    main()
