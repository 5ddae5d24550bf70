"""Histogram of the shipped policy's response lengths on the held-out prompts.

    python -m rollpacker.examples.plot_lengths [--policy assets/policy] [--out docs/length_histogram.png]

Samples exactly as ``policy_report`` does (same seed, same figures) and draws
the lengths of all responses on a log-scale count axis, with the median and
the maximum marked: the long tail that tail batching exists for.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from rollpacker.examples.policy_report import evaluate_policy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="assets/policy")
    parser.add_argument("--data", default="assets/data/eval.jsonl")
    parser.add_argument("--out", default="docs/length_histogram.png")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report, lengths = evaluate_policy(args.policy, args.data, n=args.n, seed=args.seed)
    flat = [length for row in lengths for length in row]
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=120)
    ax.hist(flat, bins=range(0, max(flat) + 10, 7), color="#4c72b0")
    ax.set_yscale("log")
    ax.axvline(report.median_length, color="#dd8452", linestyle="--", label=f"median {report.median_length:.0f}")
    ax.axvline(report.max_length, color="#c44e52", linestyle=":", label=f"max {report.max_length}")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("responses (log scale)")
    ax.set_title(f"stepchain: {report.num_prompts} held-out prompts x {report.responses_per_prompt} samples, "
                 f"pass@1 {report.pass_at_1:.2f}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(report.summary())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
