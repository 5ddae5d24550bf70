"""Plot a run's eval curve beside its training reward, from ``metrics.jsonl``.

    python -m rollpacker.examples.plot_eval runs/tiny-cpu/metrics.jsonl [--output docs/eval_curve.png]

Training lines give ``reward_mean`` per step; eval lines (``eval/*`` keys, the step whose weights
were evaluated, 0 for the starting policy) give ``eval/<sampling>/pass@1`` for every sampling of
``run.eval.samplings``, and ``pass@n`` where n > 1.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def curves(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """label -> (steps, values): the training reward and each top-level eval pass@k."""
    out: dict[str, tuple[list[int], list[float]]] = {}

    def add(label: str, step: int, value: float) -> None:
        steps, values = out.setdefault(label, ([], []))
        steps.append(step)
        values.append(value)

    for r in sorted(rows, key=lambda r: r["step"]):
        if "reward_mean" in r:
            add("train reward (mean)", r["step"], r["reward_mean"])
        for key, value in r.items():
            if re.fullmatch(r"eval/[^/]+/pass@\d+", key):
                add(key, r["step"], value)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rollpacker.examples.plot_eval", description=__doc__.split("\n")[0])
    p.add_argument("metrics", type=Path, help="RUN_DIR/metrics.jsonl")
    p.add_argument("--output", type=Path, help="image to write (default: eval_curve.png beside the metrics)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    data = curves(rows)
    if not any(k.startswith("eval/") for k in data):
        raise SystemExit(f"{args.metrics}: no eval lines (is run.eval on and data.eval_files set?)")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (steps, values) in data.items():
        style = dict(marker="o") if label.startswith("eval/") else dict(alpha=0.6)
        ax.plot(steps, values, label=label, **style)
    ax.set_xlabel("step (eval: the step whose weights were evaluated)")
    ax.set_ylabel("reward / pass rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, ncol=2)
    ax.set_title(str(args.metrics), fontsize=9)
    fig.tight_layout()
    output = args.output or args.metrics.with_name("eval_curve.png")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    print(f"wrote {output}: " + ", ".join(f"{k} {len(v[0])} points" for k, v in data.items()))


if __name__ == "__main__":
    main()
