"""sglang's ``meta_info["routed_experts"]`` read into ``Completion.routed_experts`` (the real engine's
rows: tests/sglang_cpu/moe_checks.py). Here the translation alone: the sparse layers kept in order,
and every malformed answer refused with what is wrong."""
from __future__ import annotations

import base64

import pytest
import torch

from rollpacker.rollout.sglang_routing import RoutingLayout


def _meta(rows: torch.Tensor) -> dict:
    return {"routed_experts": base64.b64encode(rows.to(torch.int32).numpy().tobytes()).decode()}


def test_the_sparse_layers_are_kept_in_order_and_the_dense_ones_dropped():
    rows = torch.arange(5 * 3 * 2).view(5, 3, 2)  # 5 positions, 3 layers, top-2
    partly = RoutingLayout(num_layers=3, moe_layers=(0, 2), top_k=2)
    assert list(partly.decode(_meta(rows), 5)) == rows[:, [0, 2]].flatten().tolist()
    every = RoutingLayout(num_layers=3, moe_layers=(0, 1, 2), top_k=2)
    assert list(every.decode(_meta(rows), 5)) == rows.flatten().tolist()


def test_a_malformed_or_missing_answer_is_refused_and_an_aborted_one_kept_as_given():
    layout = RoutingLayout(num_layers=3, moe_layers=(0, 1, 2), top_k=2)
    rows = torch.zeros(4, 3, 2)
    with pytest.raises(ValueError, match="routing for 4 positions; the request fed 5"):
        layout.decode(_meta(rows), 5)
    with pytest.raises(ValueError, match="not whole positions of 3 layers x top-2"):
        layout.decode({"routed_experts": base64.b64encode(b"\0" * 20).decode()}, 5)
    with pytest.raises(ValueError, match="no routed_experts for a finished request"):
        layout.decode({}, 5)
    assert list(layout.decode({}, None)) == []
    assert len(layout.decode(_meta(rows), None)) == 4 * 3 * 2
