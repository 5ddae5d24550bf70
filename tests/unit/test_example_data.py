"""rollpacker.examples.make_data: stepchain training prompts with a chosen range of step counts."""
from __future__ import annotations

import json

import pytest

from rollpacker.examples import make_data, task


def test_rows_have_the_asked_step_counts_and_their_own_answers():
    rows = make_data.rows(300, seed=7, min_steps=2, max_steps=4)
    assert {r["extra_info"]["num_steps"] for r in rows} == {2, 3, 4}
    for r in rows:
        words = r["prompt"][0]["content"].split()
        problem = task.Problem(int(words[2].rstrip(",")), words[4], int(words[5]))
        assert problem.num_steps == r["extra_info"]["num_steps"]
        assert str(problem.answer()) == r["reward_model"]["ground_truth"]
    assert rows == make_data.rows(300, seed=7, min_steps=2, max_steps=4)
    with pytest.raises(ValueError):
        make_data.rows(1, seed=0, min_steps=3, max_steps=2)


def test_default_is_the_sweeps_single_step_file(tmp_path):
    out = tmp_path / "train.jsonl"
    make_data.main(["--out", str(out), "--rows", "50"])
    lines = out.read_text().splitlines()
    assert len(lines) == 50 and all('"num_steps": 1}' in line for line in lines)
    assert out.read_text() == "".join(json.dumps(r) + "\n" for r in make_data.rows(50, 3005, 1, 1))
