"""``python -m rollpacker.sim``: baseline vs tail batching on a modeled H800 cluster.

    python -m rollpacker.sim --trace lengths.jsonl            # Qwen2.5-14B, 32 GPUs, TP 2, 16k
    python -m rollpacker.sim --model 32b --gpus 64 --limit 32768 --json
    python -m rollpacker.sim --planner                        # per-round-kind TP, online rule

Without ``--trace`` the lengths come from the parametric long-tail model
(``rollpacker.sim.traces``). ``--json`` prints the same report as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

from rollpacker.sim.perf import Efficiency
from rollpacker.sim.run import SimSettings, row_dict, run_mode, summarize
from rollpacker.sim.traces import TraceError, load_trace, longtail_trace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d, e = SimSettings(), Efficiency()
    p = argparse.ArgumentParser(prog="python -m rollpacker.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="JSONL length trace; default: the parametric long-tail model")
    p.add_argument("--model", default=d.model, choices=["7b", "14b", "32b"])
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--tp", type=int, default=d.tp, help="rollout TP (initial TP with --planner)")
    p.add_argument("--p0", type=int, default=d.p0)
    p.add_argument("--r0", type=int, default=d.r0)
    p.add_argument("--eta", type=float, help="sets both --eta-p and --eta-r")
    p.add_argument("--eta-p", type=float, default=d.eta_p)
    p.add_argument("--eta-r", type=float, default=d.eta_r)
    p.add_argument("--limit", type=int, default=d.limit, help="max response length (tokens)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds per mode")
    p.add_argument("--planner", action="store_true", help="tail batching with the parallelism planner")
    p.add_argument("--max-tp", type=int, default=d.max_tp, help="GPUs per node")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("parametric long-tail model (without --trace)")
    g.add_argument("--num-prompts", type=int, default=2048)
    g.add_argument("--median", type=float, help="median response length; default limit/28")
    g.add_argument("--sigma-prompt", type=float, default=0.8)
    g.add_argument("--sigma-response", type=float, default=0.65)
    g.add_argument("--prompt-length", type=int, default=256)
    h = p.add_argument_group("hardware efficiency")
    h.add_argument("--bandwidth", type=float, default=e.bandwidth, help="achieved share of HBM bandwidth")
    h.add_argument("--mfu", type=float, default=e.mfu)
    h.add_argument("--step-overhead-ms", type=float, default=e.step_overhead_s * 1e3)
    h.add_argument("--allreduce-us", type=float, default=e.allreduce_s * 1e6)
    h.add_argument("--mem-fraction", type=float, default=e.mem_fraction)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.eta is not None:
        args.eta_p = args.eta_r = args.eta
    return args


def simulate(args: argparse.Namespace) -> dict:
    settings = SimSettings(
        model=args.model, gpus=args.gpus, tp=args.tp, p0=args.p0, r0=args.r0, eta_p=args.eta_p, eta_r=args.eta_r,
        limit=args.limit, rounds=args.rounds, planner=args.planner, max_tp=args.max_tp, seed=args.seed,
        efficiency=Efficiency(bandwidth=args.bandwidth, mfu=args.mfu, step_overhead_s=args.step_overhead_ms / 1e3,
                              allreduce_s=args.allreduce_us / 1e6, mem_fraction=args.mem_fraction))
    if args.trace:
        trace, length_model = load_trace(args.trace), f"trace {args.trace}"
    else:
        median = args.median or args.limit / 28
        samples = max(args.r0, -(-int(args.eta_r * args.r0 * 1000) // 1000))
        trace = longtail_trace(args.num_prompts, samples=samples, median=median, limit=args.limit,
                               sigma_prompt=args.sigma_prompt, sigma_response=args.sigma_response,
                               prompt_length=args.prompt_length, seed=args.seed)
        length_model = (f"log-normal: median {median:.0f} x exp(N(0,{args.sigma_prompt})) per prompt "
                        f"x exp(N(0,{args.sigma_response})) per response, clipped to {args.limit}")
    baseline = run_mode("baseline", settings, trace)
    tail = run_mode("tail_batching", settings, trace)
    return {"settings": {k: v for k, v in vars(args).items() if k != "json"}, "length_model": length_model,
            "baseline": [row_dict(r) for r in baseline], "tail_batching": [row_dict(r) for r in tail],
            "summary": summarize(baseline, tail)}


def print_report(report: dict) -> None:
    s = report["settings"]
    print(f"Qwen2.5-{s['model'].upper()} on {s['gpus']} x H800, rollout TP {s['tp']}{' + planner' if s['planner'] else ''}, "
          f"P0={s['p0']} R0={s['r0']} eta_p={s['eta_p']} eta_r={s['eta_r']}, limit {s['limit']}")
    print(f"lengths: {report['length_model']}")
    header = f"{'mode':<14}{'round':>6} {'kind':<9}{'tp':>3}{'rollout s':>11}{'bubble':>8}" \
             f"{'gen tok':>11}{'wasted tok':>12}{'preempt':>9}{'queue':>7}"
    print(header)
    for mode in ("baseline", "tail_batching"):
        for r in report[mode]:
            print(f"{mode:<14}{r['index']:>6} {r['kind']:<9}{r['tp']:>3}{r['rollout_seconds']:>11.1f}"
                  f"{r['bubble_fraction']:>8.2f}{r['generated_tokens']:>11}{r['wasted_tokens']:>12}"
                  f"{r['preemptions']:>9}{r['queue_length']:>7}")
    m = report["summary"]
    print(f"baseline mean {m['baseline_mean_s']:.1f} s/step (bubble {m['baseline_bubble']:.2f}, "
          f"max/median length {m['baseline_max_over_median']:.1f}); tail batching mean {m['tail_mean_s']:.1f} s/step "
          f"(short {m['short_mean_s']:.1f} s, long {m['long_mean_s']:.1f} s, bubble {m['tail_bubble']:.2f}, "
          f"wasted {100 * m['tail_wasted_fraction']:.0f}% of generated tokens)")
    print(f"speedup: amortized {m['speedup']:.2f}x, short rounds {m['short_round_speedup']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = simulate(args)
    except (TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
