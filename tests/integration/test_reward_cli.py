"""``python -m rollpacker.reward score``: one output line per input line, in order."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cli_scores_every_line_in_order_and_reports_the_malformed_one(tmp_path):
    lines = [
        {"data_source": "math", "response": r"\boxed{\frac{1}{2}}", "ground_truth": "0.5"},
        '{"data_source": "math", "response": "\\\\boxed{3}"',  # truncated JSON
        {"data_source": "code", "response": "```python\nprint(input()[::-1])\n```",
         "tests": [{"stdin": "abc\n", "stdout": "cba\n"}]},
        {"data_source": "gsm8k", "response": r"The answer is \boxed{41}", "ground_truth": "42"},
        {"data_source": "code", "response": "no program here", "tests": [{"stdin": "", "stdout": ""}]},
        {"data_source": "math", "ground_truth": "1"},  # no response
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "rollpacker.reward", "score", str(src), "-o", str(out),
                           "--set", "num_workers=2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # some lines were malformed
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reason"] for r in results] == ["ok", "error", "ok", "wrong_answer", "no_answer", "error"]
    assert [r["reward"] for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert all(set(r) == {"reward", "correct", "reason", "seconds"} for r in results)
    assert f"{src}:2: not valid JSON" in proc.stderr
    assert f"{src}:6: field 'response' must be a string" in proc.stderr


def test_cli_rejects_an_unknown_config_key(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("")
    proc = subprocess.run([sys.executable, "-m", "rollpacker.reward", "score", str(src), "--set", "num_worker=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "did you mean 'reward.num_workers'" in proc.stderr
