"""Convert a public math dataset to the verl rows that ``PromptDataset`` reads.

    rollpacker-prepare --source {gsm8k,math} --input RAW.(jsonl|parquet) \\
        --output OUT.(jsonl|parquet) [--split-eval N]

GSM8K rows carry ``question`` and ``answer`` (final answer after ``#### ``);
MATH (Hendrycks) rows carry ``problem`` and ``solution`` (final answer in the
last ``\\boxed{...}``) and optionally ``level`` and ``type``. The raw file is
downloaded by the user; nothing here touches the network. Rows whose answer
cannot be extracted are skipped, counted and their row numbers reported.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from rollpacker.cli_help import HelpFormatter
from rollpacker.reward.scorers.boxed import last_boxed

# "gsm8k" and "math" both route to the math-verify scorer (rollpacker/reward/scorers/__init__.py).
DATA_SOURCE = {"gsm8k": "gsm8k", "math": "math"}
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SHOWN_SKIPS = 5  # row numbers printed for skipped rows; the count covers them all


def gsm8k_answer(answer: str) -> str | None:
    """The text after the last ``####``; GSM8K writes thousands as ``1,000``, math-verify wants ``1000``."""
    if "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return final or None


def _gsm8k(row: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        return "", None, {}
    return question, gsm8k_answer(answer), {}


def _math(row: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    problem, solution = row.get("problem"), row.get("solution")
    if not isinstance(problem, str) or not isinstance(solution, str):
        return "", None, {}
    extra = {key: row[key] for key in ("level", "type") if row.get(key) is not None}
    return problem, last_boxed(solution), extra


EXTRACT: dict[str, Callable[[dict[str, Any]], tuple[str, str | None, dict[str, Any]]]] = {
    "gsm8k": _gsm8k, "math": _math}


def read_rows(path: Path) -> Iterator[Any]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        yield None  # counted as a skipped row rather than ending the whole conversion
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    else:
        raise SystemExit(f"{path}: unsupported format {path.suffix!r} (use .jsonl or .parquet)")


def convert(rows: Iterator[Any], source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """verl rows, and the 0-based numbers of the raw rows skipped for want of a question or answer."""
    out: list[dict[str, Any]] = []
    skipped: list[int] = []
    for number, row in enumerate(rows):
        question, answer, extra = EXTRACT[source](row) if isinstance(row, dict) else ("", None, {})
        if not question.strip() or answer is None:
            skipped.append(number)
            continue
        out.append({
            "data_source": DATA_SOURCE[source],
            "prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            # index is the raw row number, so a trained prompt can be traced back to the source file.
            "extra_info": {"index": number, **extra},
        })
    return out, skipped


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        raise SystemExit(f"{path}: unsupported format {path.suffix!r} (use .jsonl or .parquet)")


def eval_path(output: Path) -> Path:
    return output.with_name(f"{output.stem}.eval{output.suffix}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollpacker-prepare", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--source", choices=sorted(EXTRACT), required=True)
    parser.add_argument("--input", type=Path, required=True, help="raw dataset file (.jsonl or .parquet)")
    parser.add_argument("--output", type=Path, required=True, help="verl rows to write (.jsonl or .parquet)")
    parser.add_argument("--split-eval", type=int, default=0, metavar="N",
                        help="write the last N converted rows to OUT.eval.EXT instead of OUT")
    args = parser.parse_args(argv)
    if not args.input.is_file():
        parser.error(f"input file {args.input} does not exist")
    for path in (args.input, args.output):
        if path.suffix not in (".jsonl", ".parquet"):
            parser.error(f"{path}: unsupported format {path.suffix!r} (use .jsonl or .parquet)")
    rows, skipped = convert(read_rows(args.input), args.source)
    if not rows:
        parser.error(f"{args.input}: no row had a question and an extractable answer ({len(skipped)} skipped)")
    if not 0 <= args.split_eval < len(rows):
        parser.error(f"--split-eval {args.split_eval} must be >= 0 and leave training rows "
                     f"({len(rows)} converted)")
    # The eval rows are the last N, so the split is the same on every run of the command.
    train = rows[:len(rows) - args.split_eval]
    write_rows(args.output, train)
    print(f"wrote {len(train)} rows to {args.output}", file=sys.stderr)
    if args.split_eval:
        write_rows(eval_path(args.output), rows[len(train):])
        print(f"wrote {args.split_eval} rows to {eval_path(args.output)}", file=sys.stderr)
    if skipped:
        shown = ", ".join(map(str, skipped[:SHOWN_SKIPS])) + (", ..." if len(skipped) > SHOWN_SKIPS else "")
        print(f"skipped {len(skipped)} rows without an extractable answer (0-based row numbers: {shown})",
              file=sys.stderr)
    else:
        print("skipped 0 rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
