"""Does tail batching cost accuracy, and is the short rounds' response race the cause?

    python -m bench.e2e.race_bias [--seeds 3,4,5] [--steps 10] [--out runs/race_bias]
                              [--results bench/results/race_bias.json]

Three configurations of the real program (``configs/tiny-cpu.yaml``, P0=16,
R0=4), each at every seed (seed = data order + sampling + Megatron init, the
same across configurations):

* baseline   - synchronous: every response of P0 x R0 trained;
* rollpacker - every component, as shipped: short rounds launch 5 responses
               per prompt and keep the first R0=4 to finish (the response race);
* no_race    - the same with ``scheduler.eta_r=1``: short rounds still over-launch
               prompts and defer the slow ones to long rounds, but keep every
               response of a finished prompt, so no response is dropped for being long.

After each run, its final policy is sampled on the held-out prompts (4 per
prompt, same sampling seed for every policy). Printed: held-out pass@1 and
median response length per run, each configuration's mean, and its paired
difference from the baseline of the same seed (mean and 95% t-interval over
seeds), also written to ``--results`` (tracked; the table in docs/results.md is rendered
from it by ``python -m bench.tools.report``). If
``no_race`` matches the baseline while ``rollpacker`` does not, the response
race is the cause. Runs are not timed here (``bench/e2e/ablation.py`` does that).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.e2e import ablation as e2e
from bench.e2e import stats as rep
from bench.tools.results import write_results

CONFIGS = {"baseline": rep.MODES[0].overrides, "rollpacker": rep.MODES[-1].overrides,
           "no_race": {**rep.MODES[-1].overrides, "scheduler.eta_r": "1.0"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.race_bias", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="3,4,5", help="comma-separated")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--p0", type=int, default=16)
    p.add_argument("--r0", type=int, default=4)
    p.add_argument("--eval-n", type=int, default=4)
    p.add_argument("--out", default="runs/race_bias")
    p.add_argument("--results", default="bench/results/race_bias.json", help="raw results (tracked)")
    p.add_argument("--chunk-timeout", type=float, default=3600.0)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(f"{key}-s{seed}", rep.Mode(key, key, overrides), seed)
            for seed in seeds for key, overrides in CONFIGS.items()]
    if not args.report_only:
        for name, mode, seed in runs:
            if not (out / name / "metrics.jsonl").exists():
                e2e.run_chunk(args, name, mode, seed, args.steps)
            print(f"  {name}: trained; held-out {e2e.held_out_runs(out, [name], args.eval_n)[name]}", flush=True)
    evals = e2e.held_out_runs(out, ["start", *(name for name, _, _ in runs)], args.eval_n)
    result: dict = {"settings": {k: v for k, v in vars(args).items()}, "seeds": seeds, "start": evals["start"],
                    "runs": {key: {s: evals[f"{key}-s{s}"] for s in seeds} for key in CONFIGS}}
    pass_at_1 = {key: {s: r["pass_at_1"] for s, r in runs_.items()} for key, runs_ in result["runs"].items()}
    result["paired"] = {key: rep.paired_difference(pass_at_1["baseline"], pass_at_1[key])
                        for key in CONFIGS if key != "baseline"}
    path = write_results(args.results, result)
    print(f"held-out pass@1 ({args.eval_n} samples per prompt), starting policy {evals['start']['pass_at_1']:.3f}")
    for key, p_ in result["paired"].items():
        print(f"  {key}: " + rep.paired_text(p_, f"{key}'s held-out pass@1"))
    print(f"raw results: {path} (docs/results.md: python -m bench.tools.report)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
