"""``rollpacker-reward score INPUT.jsonl [-o OUT.jsonl]`` (or ``python -m rollpacker.reward``): score a file offline.

Each input line is ``{"data_source", "response", "ground_truth" | "tests"}``
(optionally ``"key"``, the prompt id for adaptive code timeouts).  Each output
line is ``{"reward", "correct", "reason", "seconds"}``, one per input line and
in the same order.  A malformed line is reported on stderr with its line number
and scored as ``error``; the exit status is then 1.  Scoring uses the same
worker pool as training.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from rollpacker.cli_help import HelpFormatter
from rollpacker.configlib import ConfigError, apply_overrides, build, load_yaml
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.pool import RewardPool
from rollpacker.reward.score import ERROR, Score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollpacker-reward", description="Score responses offline with the "
                                     "reward pool that training uses.")
    commands = parser.add_subparsers(dest="command", required=True)
    score = commands.add_parser("score", help="score a JSONL file of responses", description=__doc__,
                                formatter_class=HelpFormatter)
    score.add_argument("input", type=Path)
    score.add_argument("-o", "--output", type=Path, help="output JSONL (default: stdout)")
    score.add_argument("-c", "--config", type=Path, help="YAML run config whose 'reward' section to use")
    score.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a reward config key, e.g. --set num_workers=4")
    args = parser.parse_args(argv)
    try:
        cfg = _config(args.config, args.set)
    except ConfigError as exc:
        parser.error(str(exc))
    if not args.input.is_file():
        parser.error(f"input file {args.input} does not exist")
    with args.input.open(encoding="utf-8") as src, RewardPool(cfg) as pool:
        results, malformed = _submit_all(pool, src, str(args.input))
        if args.output is None:
            _write(results, sys.stdout)
        else:
            with args.output.open("w", encoding="utf-8") as out:
                _write(results, out)
    return 1 if malformed else 0


def _config(path: Path | None, overrides: list[str]) -> RewardConfig:
    section = load_yaml(path).get("reward", {}) if path else {}
    data = apply_overrides({"reward": dict(section or {})}, [f"reward.{o}" for o in overrides], "--set")
    return build(RewardConfig, data["reward"], where="reward", source=str(path or "--set"))


def _submit_all(pool: RewardPool, src: IO[str], name: str) -> tuple[list[Future | Score], int]:
    results: list[Future | Score] = []
    malformed = 0
    for number, line in enumerate(src, start=1):
        try:
            data_source, response, label, key = _parse(line)
            results.append(pool.submit(data_source, response, label, key=key))
        except ValueError as exc:
            print(f"{name}:{number}: {exc}", file=sys.stderr)
            results.append(Score.failed(ERROR, str(exc)))
            malformed += 1
    return results, malformed


def _parse(line: str) -> tuple[str, str, Any, str | None]:
    """(data_source, response, label, key) from one input line; ValueError says what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    for field in ("data_source", "response"):
        if not isinstance(record.get(field), str):
            raise ValueError(f"field {field!r} must be a string")
    if "tests" in record:
        label = record["tests"]
    elif "ground_truth" in record:
        label = record["ground_truth"]
    else:
        raise ValueError("needs 'ground_truth' (math, built-in task) or 'tests' (code)")
    key = record.get("key")
    return record["data_source"], record["response"], label, None if key is None else str(key)


def _write(results: list[Future | Score], out: IO[str]) -> None:
    reasons: collections.Counter[str] = collections.Counter()
    total = 0.0
    from tqdm import tqdm

    for result in tqdm(results, unit="line", desc="score", disable=None, leave=False):
        score = result if isinstance(result, Score) else result.result()
        reasons[score.reason] += 1
        total += score.reward
        out.write(json.dumps(score.to_json()) + "\n")
    mean = total / len(results) if results else 0.0
    print(f"scored {len(results)} lines, mean reward {mean:.4f}, reasons {dict(reasons)}", file=sys.stderr)
