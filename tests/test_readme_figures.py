"""The README's generated tables equal what ``python -m bench.report`` renders from ``bench/results/``."""
from __future__ import annotations

import json

from bench import report


def test_generated_blocks_match_their_results_files():
    text = report.README.read_text()
    names = [m["name"] for m in report.BLOCK.finditer(text)]
    assert set(names) == set(report.RENDERERS), names  # every results file the README draws on has its block
    for name in names:
        results = json.loads((report.RESULTS / f"{name}.json").read_text())
        assert {"command", "commit", "date", "machine"} <= set(results), name
    assert report.main(["--check"]) == 0, "README.md is stale: run python -m bench.report"
