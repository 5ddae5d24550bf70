"""Reward benchmarks: one run, each part against its baseline in the same run, ratios printed.

1. math  - throughput of a RewardPool with 2 workers vs scoring in the calling (training)
           process, same samples, same scorer.  The issue asks for 10,000 samples; the default
           is 1,000 so the part stays under two minutes on a 2-core machine (--math-samples 10000).
2. code  - a code set where 5% of the responses loop forever: total reward time with the
           adaptive timeout vs a fixed 30 s timeout.  Default 12 prompts x 5 responses (3 loops);
           anchors are warm (one earlier epoch of correct solutions, as after a checkpoint
           restore); --cold also times an epoch that starts with no anchors.
The third benchmark of the issue (reward time hidden behind rollout) needs the rollout
engine and lives with the scheduler's benchmarks, not here.

    python -m bench.micro.reward [--parts math,code] [--math-samples N] [--code-prompts P] ... [--out FILE]

The timings of every part go to ``--out`` (default ``bench/results/reward.json``), from which
``python -m bench.tools.report`` renders the table in docs/results.md (also printed).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from bench.tools import report
from bench.tools.results import REPO, write_results
from rollpacker.reward import RewardConfig, RewardPool
from rollpacker.reward.scorers.math_answer import score_math

MODULUS = 1_000_003
CODE_SOLUTION = "```python\nn = int(input())\ns = 0\nfor i in range(n):\n    s += i * i\nprint(s % {m})\n```"
CODE_WRONG = "```python\nprint(int(input()) % 7)\n```"
CODE_LOOP = "```python\nwhile True:\n    pass\n```"


def math_samples(n: int, seed: int) -> list[tuple[str, str]]:
    """(response, ground truth) pairs in the usual shapes: fractions, radicals, intervals, integers."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        truth = [f"\\frac{{{a}}}{{{b}}}", str(a * b), f"{a}\\sqrt{{{b}}}", f"[{a},{a + b})"][i % 4]
        answer = truth if rng.random() < 0.6 else str(a + b)
        samples.append((f"First take {a} and {b}, then combine them. So the result is $\\boxed{{{answer}}}$.", truth))
    return samples


def bench_math(args: argparse.Namespace) -> dict:
    samples = math_samples(args.math_samples, args.seed)
    cfg = RewardConfig(num_workers=args.math_workers)
    score_math("\\boxed{1}", "1", cfg.math_timeout)  # same warm-up the workers do before they report ready
    start = time.perf_counter()
    inline = [score_math(response, truth, cfg.math_timeout).reward for response, truth in samples]
    inline_s = time.perf_counter() - start

    with RewardPool(cfg) as pool:
        started = time.perf_counter()
        pool.wait_ready()
        startup_s = time.perf_counter() - started
        start = time.perf_counter()
        futures = [pool.submit("math", response, truth) for response, truth in samples]
        pooled = [f.result().reward for f in futures]
        pooled_s = time.perf_counter() - start
    assert pooled == inline, "the pool and the in-process scorer disagree"
    n = len(samples)
    print(f"[math] {n} samples, mean reward {sum(inline) / n:.3f}")
    print(f"[math] in-process         : {inline_s:8.2f} s  {n / inline_s:8.1f} samples/s")
    print(f"[math] pool, {args.math_workers} workers     : {pooled_s:8.2f} s  {n / pooled_s:8.1f} samples/s"
          f"  (+{startup_s:.1f} s one-time worker start-up)")
    print(f"[math] speedup pool / in-process: {inline_s / pooled_s:.2f}x on {os.cpu_count()} cores")
    return {"samples": n, "workers": args.math_workers, "mean_reward": sum(inline) / n, "in_process_s": inline_s,
            "pool_s": pooled_s, "pool_startup_s": startup_s, "speedup": inline_s / pooled_s}


def code_set(args: argparse.Namespace) -> list[tuple[str, str, list[dict]]]:
    """(key, response, tests): each prompt's correct solution runs for its own, prompt-specific time."""
    rng = random.Random(args.seed)
    samples = []
    for p in range(args.code_prompts):
        sizes = [rng.randint(300_000, 1_500_000) for _ in range(2)]
        tests = [{"stdin": f"{n}\n", "stdout": f"{(n - 1) * n * (2 * n - 1) // 6 % MODULUS}\n"} for n in sizes]
        for _ in range(args.code_responses):
            response = CODE_SOLUTION.format(m=MODULUS) if rng.random() < 0.8 else CODE_WRONG
            samples.append((f"prompt-{p}", response, tests))
    loops = max(1, round(args.loop_frac * len(samples)))
    for i in rng.sample(range(len(samples)), loops):
        samples[i] = (samples[i][0], CODE_LOOP, samples[i][2])
    rng.shuffle(samples)  # completion order of a rollout, not prompt order
    return samples


def time_code_epoch(cfg: RewardConfig, samples, warm_up) -> tuple[float, list]:
    with RewardPool(cfg) as pool:
        pool.wait_ready()
        if warm_up:  # an earlier epoch's correct solutions, as restored from a checkpoint
            for f in [pool.submit("code", CODE_SOLUTION.format(m=MODULUS), tests, key=key)
                      for key, tests in {k: t for k, _, t in samples}.items()]:
                f.result()
        start = time.perf_counter()
        scores = [f.result() for f in [pool.submit("code", r, t, key=k) for k, r, t in samples]]
        return time.perf_counter() - start, scores


def bench_code(args: argparse.Namespace) -> dict:
    samples = code_set(args)
    loops = sum(r == CODE_LOOP for _, r, _ in samples)
    base = dict(num_workers=args.code_workers, code_t_max=args.t_max, code_fixed_timeout=args.t_max)
    print(f"[code] {len(samples)} samples ({args.code_prompts} prompts x {args.code_responses}), "
          f"{loops} loop forever; T_max = fixed timeout = {args.t_max:g} s, {args.code_workers} workers")
    fixed_s, fixed = time_code_epoch(RewardConfig(code_timeout="fixed", **base), samples, warm_up=False)
    runs = [("adaptive, warm anchors", True)] + ([("adaptive, cold anchors", False)] if args.cold else [])
    print(f"[code] fixed {args.t_max:g} s timeout     : {fixed_s:8.2f} s", flush=True)
    adaptive_runs = {}
    for name, warm in runs:
        adaptive_s, adaptive = time_code_epoch(RewardConfig(code_timeout="adaptive", **base), samples, warm)
        cut = sum(f.correct and not a.correct for f, a in zip(fixed, adaptive))
        adaptive_runs[name] = {"seconds": adaptive_s, "speedup": fixed_s / adaptive_s, "correct_cut": cut}
        print(f"[code] {name:24s}: {adaptive_s:8.2f} s  speedup {fixed_s / adaptive_s:.2f}x, "
              f"correct solutions cut by the adaptive timeout: {cut}", flush=True)
    return {"samples": len(samples), "loops": loops, "workers": args.code_workers, "t_max": args.t_max,
            "fixed_s": fixed_s, "adaptive": adaptive_runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="math,code")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--math-samples", type=int, default=1000)
    parser.add_argument("--math-workers", type=int, default=2)
    parser.add_argument("--code-prompts", type=int, default=12)
    parser.add_argument("--code-responses", type=int, default=5)
    parser.add_argument("--code-workers", type=int, default=2)
    parser.add_argument("--loop-frac", type=float, default=0.05)
    parser.add_argument("--t-max", type=float, default=30.0)
    parser.add_argument("--cold", action="store_true", help="also time an adaptive epoch with no prior anchors")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "reward.json"), help="raw results (JSON)")
    args = parser.parse_args()
    parts = {"math": bench_math, "code": bench_code}
    results = {name: parts[name](args) for name in args.parts.split(",")}
    path = write_results(args.out, {"settings": {k: v for k, v in vars(args).items() if k != "out"}, **results})
    print(report.reward(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
