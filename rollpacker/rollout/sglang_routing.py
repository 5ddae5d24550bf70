"""MoE routing as sglang reports it, translated into ``Completion.routed_experts``.

With ``enable_return_routed_experts`` (``sglang_args.server_args``) and ``return_routed_experts=True``
on a request, sglang 0.5.23 puts a finished request's routing in ``meta_info["routed_experts"]``:
- base64 of the int32 bytes of a tensor [positions, every decoder layer, top-k]
  (``srt/managers/tokenizer_manager.py:2602-2609``, ``skip_tokenizer_init`` path: the scheduler's
  tensor encoded there); the tensor is rows of the capturer's host buffer, shaped
  (KV slots, ``num_hidden_layers``, ``num_experts_per_tok``) (``srt/state_capturer/base.py:67-74``,
  ``routed_experts.py:72-73``), each sparse layer writing its row at its own layer id;
- positions ``[routed_experts_start_len, seqlen - 1)`` with ``seqlen`` = input ids + output ids
  through the stop (``srt/managers/scheduler_components/batch_result_processor.py:136-160``,
  ``state_capturer/base.py:173-188``, ``get_topk``); the start defaults to 0 (``io_struct.py:264-268``) and the
  driver never sets it, so the positions start at the prompt's first token. A resumed request's
  input is its prompt and resumed tokens, so its rows cover those tokens too, as the contract asks;
- collected only when a request finishes in the scheduler (``batch_result_processor.py:380-382``,
  ``:1450``): a request aborted before it ran has none.

Top-k order: each row is the ``topk_ids`` the router produced (``srt/layers/moe/topk.py:2574``). On
sglang's plain-torch path (CPU without AMX: ``kernels/fused_op.py:187``, ``TopK.forward_native``)
that is ``torch.topk`` of the softmax (``topk.py:1134``, sorted), descending weight as the contract
asks; the verification in ``tests/sglang_cpu/moe_checks.py`` runs there. On a GPU the Triton gate
(``topk.py:1301``, ``kernels/ops/moe/moe_fused_gate.py``) chooses the same set; its order is not
checked here, and sglang returns no weights to sort by.

Recomputed positions (a retracted request prefilled again) hold the routing of their latest forward,
not their first: the capturer overwrites a KV slot's row at every forward that writes the slot
(``base.py:190-221``, ``on_forward_end``). A prefix served from sglang's radix cache keeps the rows of the
forward that filled its slots.
"""
from __future__ import annotations

import base64
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from rollpacker.hf_spec import parse_spec


@dataclass(frozen=True)
class RoutingLayout:
    """What sglang's rows hold (``num_layers`` x ``top_k`` per position) and the sparse layers kept."""

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int

    @classmethod
    def of_model(cls, model_dir: str | Path) -> "RoutingLayout | None":
        """The layout of the checkpoint at ``model_dir``; None for a dense model, which routes nothing."""
        spec = parse_spec(model_dir)
        return cls(spec.num_layers, spec.moe_layers, spec.experts_per_token) if spec.moe_layers else None

    def decode(self, meta: Mapping[str, Any], positions: int | None) -> array:
        """``Completion.routed_experts`` from a result's ``meta_info``. ``positions``: the rows a finished
        request must have (prompt + output - 1), anything else raises; None (an aborted request): what
        sglang gave, if anything."""
        encoded = meta.get("routed_experts")
        if encoded is None:
            if positions is not None:
                raise ValueError("sglang returned no routed_experts for a finished request (was the engine "
                                 "started with enable_return_routed_experts?)")
            return array("i")
        raw = base64.b64decode(encoded)
        row = self.num_layers * self.top_k * 4
        if len(raw) % row:
            raise ValueError(f"sglang's routed_experts hold {len(raw)} bytes, not whole positions of "
                             f"{self.num_layers} layers x top-{self.top_k} int32")
        rows = len(raw) // row
        if positions is not None and rows != positions:
            raise ValueError(f"sglang reported routing for {rows} positions; the request fed {positions} "
                             f"(prompt + output - 1)")
        if self.moe_layers == tuple(range(self.num_layers)):
            out = array("i")
            out.frombytes(raw)
            return out
        routed = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(rows, self.num_layers, self.top_k)
        out = array("i")
        out.frombytes(routed[:, list(self.moe_layers)].contiguous().numpy().tobytes())
        return out
