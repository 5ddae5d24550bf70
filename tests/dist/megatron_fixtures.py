"""pytest fixtures shared by tests/test_megatron_model.py and tests/test_convert.py."""
from __future__ import annotations

import pytest

from megatron_ext.parallel import setup_layout, teardown_layout
from rollpacker.testing import make_random_qwen2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Random tiny Qwen2 checkpoints: GQA (4 heads, 2 KV heads), vocab 250 (padded), tied and untied."""
    root = tmp_path_factory.mktemp("qwen2")
    return {"tied": make_random_qwen2(root / "tied", seed=1, tie_word_embeddings=True),
            "untied": make_random_qwen2(root / "untied", seed=2)}


@pytest.fixture
def layout():
    """A TP=PP=CP=1 Megatron layout over a world of one, torn down after the test."""
    layout = setup_layout()
    yield layout
    teardown_layout(layout)
