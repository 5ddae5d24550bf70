"""pytest fixtures shared by tests/unit/test_megatron_model.py, tests/unit/test_convert.py and
tests/integration/test_convert_procs.py."""
from __future__ import annotations

import pytest

from megatron_ext.parallel import setup_layout, teardown_layout
from testkit import make_random_qwen2, make_random_qwen3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Random tiny checkpoints, GQA (4 heads, 2 KV heads), vocab 250 (padded): Qwen2 tied and untied;
    Qwen3 untied with head_dim 32 != hidden 64 / 4 heads, and Qwen3 tied with head_dim 16."""
    root = tmp_path_factory.mktemp("ckpts")
    return {"tied": make_random_qwen2(root / "tied", seed=1, tie_word_embeddings=True),
            "untied": make_random_qwen2(root / "untied", seed=2),
            "qwen3": make_random_qwen3(root / "qwen3", seed=3),
            "qwen3_tied": make_random_qwen3(root / "qwen3_tied", seed=4, tie_word_embeddings=True, head_dim=16)}


@pytest.fixture
def layout():
    """A TP=PP=CP=1 Megatron layout over a world of one, torn down after the test."""
    layout = setup_layout()
    yield layout
    teardown_layout(layout)
