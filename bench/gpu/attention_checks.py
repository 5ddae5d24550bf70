"""Packed attention's one-call kernels on the GPU (see bench/gpu/acceptance.py; CUDA only).

FlashAttention's varlen kernel and compiled FlexAttention have no CPU backward, so the CPU suite
(``tests/unit/test_packed_attention.py``) proves the project's plumbing around them and FlexAttention's
eager arithmetic; this check runs the real kernels. bf16 at Qwen2.5-7B's heads (28 query, 4 KV,
dim 128) on long-tailed spans: the output and gradients of each one-call path, and of per-sequence
SDPA, against fp32 per-sequence attention of the same inputs. A one-call path may be at most twice
as far off as per-sequence SDPA (plus 1e-3): both round the same products to bf16, so a larger
error means a wrong mask or offsets, not rounding.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_ext import packed_attention as pa

SPANS = (1000, 37, 2500, 1, 640, 4014)  # one 8,192-token micro-batch
HEADS, KV_HEADS, DIM = 28, 4, 128


def _run(path: str, q, k, v, cu, grad_out) -> list[torch.Tensor]:
    pa._last_packing.clear()
    out = pa.packed_causal_attention(q, k, v, cu, path=path)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)]


def check_packed_kernels(device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = sum(SPANS)
    q, k, v = (torch.randn(tokens, h, DIM, generator=gen, device=device).to(torch.bfloat16).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, *torch.tensor(SPANS).cumsum(0).tolist()], dtype=torch.int32)
    grad_out = torch.randn(tokens, HEADS, DIM, generator=gen, device=device).to(torch.bfloat16)
    exact = _run("per_sequence", *(t.detach().float().requires_grad_() for t in (q, k, v)), cu, grad_out.float())
    errors = {}
    for path in ("per_sequence", "varlen", "flex"):
        got = _run(path, q, k, v, cu, grad_out)
        errors[path] = [float((a.float() - b).abs().max()) for a, b in zip(got, exact)]
    bound = [2 * e + 1e-3 for e in errors["per_sequence"]]
    ok = {p: all(e <= b for e, b in zip(errors[p], bound)) for p in ("varlen", "flex")}
    return {"auto_resolves_to": pa.resolve_path("auto", q), "tokens": tokens,
            **{f"{p}_max_abs_err_out_dq_dk_dv": e for p, e in errors.items()},
            "varlen_ok": ok["varlen"], "flex_ok": ok["flex"], "ok": all(ok.values())}
