"""A random Qwen3-MoE checkpoint (every layer sparse) on the real ``sglang.Engine`` (0.5.23) on CPU,
through our ``SGLangEngine``, against transformers' ``Qwen3MoeForCausalLM`` in fp32.

    python moe_checks.py MODEL_DIR PORT   (the sglang venv's python, ``env.engine_env()``)

Greedy output equals transformers'; then ``update_weights`` pushes perturbed router, expert,
down-projection and LM-head tensors in 1 MiB buckets (several, so that a layer's experts reach
sglang's fused-expert loader in separate pushes) and greedy output equals that of transformers
loaded with the pushed weights. The last stdout line is ``VERDICT {json}``: each check is true or a
string saying what went wrong (``crashed``: a traceback); ``COUNTS`` are measurements.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from engine_checks import CPU_ENGINE_ARGS, backend_generate, compare

PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 2], [7, 8, 9, 10, 11, 12, 13, 14]]
NEW_TOKENS = 16
BUCKET_MB = 1
COUNTS = ("tokens_equal_before", "tokens_equal_after", "pushed_tensors", "push_buckets")


def transformers_greedy(model_dir: Path) -> list[list[int]]:
    """Argmax of the full-sequence forward, ``NEW_TOKENS`` per prompt, no EOS stop."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in PROMPTS:
            seq = list(ids)
            for _ in range(NEW_TOKENS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(ids):])
    return outs


def pushed_reference(model_dir: Path) -> tuple[list[tuple[str, torch.Tensor]], list[list[int]]]:
    """Perturbed router/expert/down-projection/LM-head tensors (checkpoint names, seeded) and
    transformers' greedy output with them (a copy of the checkpoint: transformers fuses the experts)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(1234)
    new = [(name, (p + torch.randn(p.shape, generator=gen) * p.std()).contiguous())
           for name, p in sorted(state.items())
           if name.endswith(("mlp.gate.weight", "down_proj.weight", "lm_head.weight")) or ".experts." in name]
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_dir / "config.json", tmp)
        save_file({**state, **dict(new)}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        return new, transformers_greedy(Path(tmp))


def equal_tokens(got: list[list[int]], want: list[list[int]]) -> str:
    same = sum(g == w for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    return f"{same}/{sum(map(len, want))}"


def main(model_dir: Path, port: int) -> dict:
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.sglang_backend import SGLangEngine, weight_buckets

    want_before = transformers_greedy(model_dir)
    new, want_after = pushed_reference(model_dir)
    buckets = list(weight_buckets(new, BUCKET_MB << 20))
    experts = [{n.split(".experts.")[0] for n, _ in b if ".experts." in n} for b in buckets]
    verdict: dict = {
        "perturbation_changes_output": True if want_after != want_before else "transformers' output did not change",
        "router_and_experts_pushed": True if any("mlp.gate.weight" in n for n, _ in new)
        and any(".experts." in n for n, _ in new) else f"pushed {[n for n, _ in new]}",
        "a_layers_experts_span_buckets": True if any(a & b for a, b in zip(experts, experts[1:]))
        else f"{len(buckets)} bucket(s), no layer's experts in two",
        "pushed_tensors": len(new), "push_buckets": len(buckets)}
    cfg = RolloutConfig(backend="sglang", sglang_base_port=port, weight_bucket_mb=BUCKET_MB,
                        kv_cache_tokens=CPU_ENGINE_ARGS["max_total_tokens"])
    eng = SGLangEngine(model_dir, cfg, engine_id=0, device="cpu")
    try:
        before = backend_generate(eng, "a", PROMPTS, NEW_TOKENS)
        verdict["backend_greedy_matches_transformers"] = compare("before update", before, want_before)
        verdict["tokens_equal_before"] = equal_tokens(before, want_before)
        eng.update_weights(iter(new))
        after = backend_generate(eng, "b", PROMPTS, NEW_TOKENS)
        verdict["backend_greedy_after_update_matches_transformers"] = compare("after update", after, want_after)
        verdict["tokens_equal_after"] = equal_tokens(after, want_after)
        verdict["push_changes_engine_output"] = True if after != before else "the engine's output did not change"
    finally:
        eng.shutdown()
    return verdict


if __name__ == "__main__":
    try:
        result = main(Path(sys.argv[1]), int(sys.argv[2]))
    except Exception:  # noqa: BLE001 - reported in the verdict
        result = {"crashed": traceback.format_exc()}
    print("VERDICT " + json.dumps(result), flush=True)
