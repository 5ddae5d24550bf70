"""The shipped starting policy, sampled: GRPO signal, a long tail, and lengths that are a property of the
prompt (transformers sampling, temperature 1.0, 4 responses per held-out prompt; docs/example.md's
figures, taken with 8, are the same). One process, but about a minute on 2 idle cores, so not in the
unit tier; the quick checks of the shipped files: tests/unit/test_policy_quality.py.
"""
from __future__ import annotations

import pytest
import torch

from rollpacker.examples.policy_report import evaluate_policy
from testkit import REPO_ROOT

POLICY = REPO_ROOT / "assets" / "policy"
EVAL = REPO_ROOT / "assets" / "data" / "eval.jsonl"


@pytest.mark.timeout(600)  # ~50 s on 2 idle cores, ~2 min when the cores are shared
def test_shipped_policy_has_grpo_signal_a_long_tail_and_prompt_bound_lengths():
    report, _ = evaluate_policy(str(POLICY), str(EVAL), n=4, seed=0, threads=torch.get_num_threads())
    print(report.summary())
    assert 0.2 <= report.pass_at_1 <= 0.8
    assert report.max_over_median >= 10
    assert report.length_spearman >= 0.5
