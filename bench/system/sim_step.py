"""The whole step on the modeled cluster at the published settings, beside the published ablation.

    python -m bench.system.sim_step [--rounds 10] [--out bench/results/sim_step.json]

For each published setting (``bench.system.sim.PUBLISHED``: Qwen2.5-7B/14B/32B at 8k/16k/32k on
16/32/64 H800, P0=128, R0=8, eta 1.25) ``rollpacker.sim.step`` runs the synchronous baseline and
the published components added one at a time (tail batching, async reward, the planner, the stream
trainer) on the same length trace, each for two full 4-short + 1-long cycles, and costs every
step's reward stage, training and weight sync with ``StepCosts``' stated defaults. The raw results
(every step of every row) go to ``--out``; ``python -m bench.tools.report`` renders the table in
docs/results.md beside the published cumulative speedups (``bench.e2e.stats.PUBLISHED_ABLATION``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from bench.e2e.stats import PUBLISHED_ABLATION
from bench.system.sim import PUBLISHED, TRACE, published_trace
from bench.tools.report import sim_step as render
from bench.tools.results import REPO, write_results
from rollpacker.sim.run import SimSettings
from rollpacker.sim.step import StepCosts, run_ablation, step_dict, summarize_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10, help="steps per row (10 = two cycles)")
    p.add_argument("--seed", type=int, default=0, help="the length model's seed")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "sim_step.json"), help="raw results (JSON)")
    args = p.parse_args()
    costs, models = StepCosts(), []
    for i, (model, limit, gpus, tp, base_s, tail_s) in enumerate(PUBLISHED):
        settings = SimSettings(model=model, gpus=gpus, tp=tp, limit=limit, rounds=args.rounds, seed=args.seed)
        steps = run_ablation(settings, published_trace(limit, args.seed), costs)
        models.append({"model": model, "limit": limit, "gpus": gpus, "tp": tp,
                       "published": {key: row[i] for key, row in PUBLISHED_ABLATION.items()},
                       "published_rollout_s": {"baseline": base_s, "tail_batching": tail_s},
                       "summary": summarize_steps(steps),
                       "steps": {key: [step_dict(r) for r in rows] for key, rows in steps.items()}})
        print(f"{model}: " + ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in models[-1]["summary"].items()), flush=True)
    d = SimSettings()
    settings = {"rounds": args.rounds, "seed": args.seed, "p0": d.p0, "r0": d.r0, "eta_p": d.eta_p,
                "eta_r": d.eta_r, "trace": TRACE, "costs": dataclasses.asdict(costs)}
    results = json.loads(write_results(args.out, {"settings": settings, "models": models}).read_text())
    print(render(results))
    print(f"raw results: {args.out}")


if __name__ == "__main__":
    main()
