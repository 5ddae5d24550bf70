"""Write stepchain training prompts with a chosen range of step counts.

    python -m rollpacker.examples.make_data --min-steps 1 --max-steps 1 --rows 4096 --seed 3005 \
        --out /tmp/train_1step.jsonl

Each row is a stepchain problem (``rollpacker.examples.task``) whose step count is drawn uniformly
from ``[--min-steps, --max-steps]`` (start value and operation uniformly, as ``task.sample_problem``
draws them), reproducible from ``--seed``: a training file with another difficulty mix than the
shipped, long-tailed ``assets/data/train.jsonl`` (data.train_files=[...] points a run at it).

The defaults write single-step problems only (260 distinct ones: 10 start values x 26 operations),
the file of the best held-out runs of the GRPO sweep in docs/example.md. The shipped policy's
weakest step is the first one, read from the prompt (teacher-forced p(correct) 0.22 there against
0.76-0.93 for the later steps), and a one-step response has no steps after a wrong one: its outcome
reward rewards or punishes exactly the step that made it, while on a long chain a wrong first step
gives every later, correct, step the same negative advantage.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rollpacker.examples import task


def rows(n: int, seed: int, min_steps: int, max_steps: int) -> list[dict]:
    if not 1 <= min_steps <= max_steps <= task.MAX_STEPS:
        raise ValueError(f"need 1 <= min_steps <= max_steps <= {task.MAX_STEPS}, got {min_steps}, {max_steps}")
    rng = random.Random(seed)
    return [task.to_row(task.sample_problem(rng, rng.randint(min_steps, max_steps)), i) for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-steps", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=1)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--seed", type=int, default=3005)
    p.add_argument("--out", default="train_1step.jsonl")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in rows(args.rows, args.seed, args.min_steps, args.max_steps):
            f.write(json.dumps(row) + "\n")
    print(f"{args.rows} rows with {args.min_steps}..{args.max_steps} steps written to {out}")


if __name__ == "__main__":
    main()
