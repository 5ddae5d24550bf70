"""The generated tables of README.md and docs/ equal what ``python -m bench.tools.report`` renders from ``bench/results/``."""
from __future__ import annotations

import json

from bench.tools import report


def test_generated_blocks_match_their_results_files():
    names = [m["name"] for text in report.pages().values() for m in report.BLOCK.finditer(text)]
    print(f"{len(names)} generated blocks in {sorted(report.pages())}")
    # every results file the docs draw on has its block, and the front page its headline
    assert set(names) == set(report.RENDERERS) | set(report.SUMMARIES), names
    for name in set(names) - set(report.SUMMARIES):
        results = json.loads((report.RESULTS / f"{name}.json").read_text())
        assert {"command", "commit", "date", "machine"} <= set(results), name
    assert report.main(["--check"]) == 0, "a generated block is stale: run python -m bench.tools.report"
