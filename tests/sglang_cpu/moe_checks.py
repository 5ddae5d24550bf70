"""A random Qwen3-MoE checkpoint (every layer sparse) on the real ``sglang.Engine`` (0.5.23) on CPU,
through our ``SGLangEngine``, against transformers' ``Qwen3MoeForCausalLM`` in fp32.

    python moe_checks.py MODEL_DIR PORT   (the sglang venv's python, ``env.engine_env()``)

The engine reports its routing (``RolloutConfig.return_routing``). Greedy output equals transformers';
every position of every request (prompt and output, a resumed request's resumed tokens included)
has the top-k experts, per sparse layer and in order, that transformers' router chooses on the
same tokens (hooks on each layer's ``mlp.gate``). Then ``update_weights`` pushes perturbed router,
expert, down-projection and LM-head tensors in 1 MiB buckets (several, so that a layer's experts
reach sglang's fused-expert loader in separate pushes), and greedy output and routing equal those of
transformers loaded with the pushed weights. The last stdout line is ``VERDICT {json}``: each check
is true or a string saying what went wrong (``crashed``: a traceback); ``COUNTS`` are measurements.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from engine_checks import CPU_ENGINE_ARGS, compare
from testkit import hf_router_topk

PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 2], [7, 8, 9, 10, 11, 12, 13, 14]]
NEW_TOKENS = 16
RESUMED = 5  # a request resumed after this many of prompt 0's greedy tokens (prefilled with its prompt)
BUCKET_MB = 1
COUNTS = ("tokens_equal_before", "tokens_equal_after", "positions_routed_equal_before", "positions_routed_equal_after",
          "pushed_tensors", "push_buckets")


def load_transformers(model_dir: Path):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def transformers_greedy(model) -> list[list[int]]:
    """Argmax of the full-sequence forward, ``NEW_TOKENS`` per prompt, no EOS stop."""
    outs = []
    with torch.no_grad():
        for ids in PROMPTS:
            seq = list(ids)
            for _ in range(NEW_TOKENS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(ids):])
    return outs


def transformers_routing(model, ids: list[int]) -> torch.Tensor:
    """The router's top-k on ``ids``: [positions, layers, k], descending weight (every layer is sparse)."""
    layers = model.config.num_hidden_layers
    return hf_router_topk(model, ids, range(layers), model.config.num_experts_per_tok)


def pushed_reference(model_dir: Path):
    """Perturbed router/expert/down-projection/LM-head tensors (checkpoint names, seeded) and
    transformers with them (a copy of the checkpoint: transformers fuses the experts)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(1234)
    new = [(name, (p + torch.randn(p.shape, generator=gen) * p.std()).contiguous())
           for name, p in sorted(state.items())
           if name.endswith(("mlp.gate.weight", "down_proj.weight", "lm_head.weight")) or ".experts." in name]
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_dir / "config.json", tmp)
        save_file({**state, **dict(new)}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        return new, load_transformers(Path(tmp))


def routed_generate(eng, tag: str, want: list[list[int]], timeout_s: float = 120) -> dict:
    """Greedy completions of ``PROMPTS``, and prompt 0 resumed after ``RESUMED`` of ``want[0]``'s tokens
    (key "resumed"), by key: prompt index or "resumed"; a request that did not finish is missing."""
    from rollpacker.rollout.engine import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    reqs = {f"{tag}-{i}": GenerationRequest(f"{tag}-{i}", ids, params) for i, ids in enumerate(PROMPTS)}
    reqs[f"{tag}-resumed"] = GenerationRequest(f"{tag}-resumed", PROMPTS[0], params, resume_ids=want[0][:RESUMED],
                                               resume_logprobs=[0.0] * RESUMED)
    eng.submit(list(reqs.values()))
    done, deadline = {}, time.monotonic() + timeout_s
    while len(done) < len(reqs) and time.monotonic() < deadline:
        done.update((c.request_id, c) for c in eng.poll(timeout=1.0) if c.request_id in reqs)
    return {rid.split("-", 1)[1]: (reqs[rid], c) for rid, c in done.items()}


def check_routing(label: str, model, got: dict, k: int) -> tuple[bool | str, str]:
    """(every fed position's experts, all layers, in order, equal to transformers' router on prompt +
    output, or what differs; "equal/positions")."""
    equal = total = 0
    problems = []
    for key, (req, c) in sorted(got.items()):
        seq = [*req.input_ids, *c.output_ids][:-1]  # the last output token is never fed
        want = transformers_routing(model, seq)
        if len(c.routed_experts) != want.numel():
            problems.append(f"{key}: {len(c.routed_experts)} ints, want {want.numel()} "
                            f"({len(seq)} positions x {want.shape[1]} layers x top-{k})")
            continue
        routed = torch.tensor(list(c.routed_experts), dtype=torch.long).view_as(want)
        same = (routed == want).all(-1).all(-1)
        equal, total = equal + int(same.sum()), total + len(same)
        if not same.all():
            pos = int((~same).nonzero()[0])
            problems.append(f"{key} position {pos}: {routed[pos].tolist()}, transformers {want[pos].tolist()}")
    if len(got) != len(PROMPTS) + 1:
        problems.append(f"only {sorted(got)} finished")
    return (True if not problems else f"{label}: {'; '.join(problems)}"), f"{equal}/{total}"


def equal_tokens(got: list[list[int]], want: list[list[int]]) -> str:
    same = sum(g == w for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    return f"{same}/{sum(map(len, want))}"


def main(model_dir: Path, port: int) -> dict:
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.sglang_backend import SGLangEngine, weight_buckets

    model_before = load_transformers(model_dir)
    want_before = transformers_greedy(model_before)
    new, model_after = pushed_reference(model_dir)
    want_after = transformers_greedy(model_after)
    k = model_before.config.num_experts_per_tok
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
                        kv_cache_tokens=CPU_ENGINE_ARGS["max_total_tokens"], return_routing=True)
    eng = SGLangEngine(model_dir, cfg, engine_id=0, device="cpu")
    outputs = {}
    try:
        for label, model, want, greedy_check in (
                ("before", model_before, want_before, "backend_greedy_matches_transformers"),
                ("after", model_after, want_after, "backend_greedy_after_update_matches_transformers")):
            if label == "after":
                eng.update_weights(iter(new))
            got = routed_generate(eng, label, want)
            outs = outputs[label] = [list(got[key][1].output_ids) if key in got else []
                                     for key in [*map(str, range(len(PROMPTS))), "resumed"]]
            verdict[greedy_check] = compare(f"{label} update", outs, [*want, want[0]])
            verdict[f"tokens_equal_{label}"] = equal_tokens(outs[:-1], want)
            verdict[f"routing_{label}_update_matches_transformers"], verdict[f"positions_routed_equal_{label}"] = \
                check_routing(f"{label} update", model, got, k)
        verdict["push_changes_engine_output"] = (True if outputs["after"] != outputs["before"]
                                                 else "the engine's output did not change")
    finally:
        eng.shutdown()
    return verdict


if __name__ == "__main__":
    try:
        result = main(Path(sys.argv[1]), int(sys.argv[2]))
    except Exception:  # noqa: BLE001 - reported in the verdict
        result = {"crashed": traceback.format_exc()}
    print("VERDICT " + json.dumps(result), flush=True)
