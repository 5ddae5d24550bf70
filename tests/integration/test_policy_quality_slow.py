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


@pytest.mark.timeout(600)  # ~1-2 min: responses up to 896 tokens
def test_recheck_policy_spreads_lengths_within_a_prompt_as_reasoning_traces_do():
    """The recheck variant's reason to exist (docs/example.md: 8 responses on all 256 prompts gave
    sigma 0.64 and 28.9x per 16 prompts); here 4 responses on the first 32 prompts."""
    report, _ = evaluate_policy(str(REPO_ROOT / "assets" / "policy-recheck"),
                                str(REPO_ROOT / "assets" / "data-recheck" / "eval.jsonl"), n=4, seed=0,
                                threads=torch.get_num_threads(), max_new_tokens=896, max_prompts=32)
    print(report.summary())
    assert 0.1 <= report.pass_at_1 <= 0.8
    assert report.within_prompt_log_sd >= 0.4  # the shipped policy's: 0.15
    assert report.step_max_over_median >= 15  # the shipped policy's: ~11
