"""torchrun script: a TP=2 reference engine over 2 ranks (gloo) against TP=1 on the leader.

Usage: engine_tp.py OLD_MODEL_DIR NEW_MODEL_DIR OUT_JSON [EP]. Both ranks form one engine over
an explicit group; rank 0 leads, rank 1 serves as follower. Rank 0 also runs TP=1
engines alone and writes greedy outputs of: TP=2 vs TP=1 on the old weights (with a
KV budget that preempts), after a release/resume of the KV cache, and after an in-place
update to the new weights vs a fresh TP=1 engine loaded from them; and the prompts. ``EP`` 2
(a MoE model): the TP-2 engine holds half of the experts whole on each rank instead of half of
every expert.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.qwen_torch import iter_safetensors
from rollpacker.rollout.reference import ReferenceEngine


def greedy(engine: ReferenceEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    engine.submit([GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=24))
                   for i, p in enumerate(prompts)])
    out = {}
    while engine.active_request_ids():
        out.update((c.request_id, c.output_ids) for c in engine.poll(None))
    return out


def main() -> None:
    old_dir, new_dir, out_path = sys.argv[1:4]
    ep = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    cfg = RolloutConfig(kv_page_size=4, kv_cache_tokens=96)
    engine = ReferenceEngine(old_dir, cfg, group=group, ep=ep)
    leader = dist.get_rank() == 0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (4, 13, 7, 22, 2)]
    result = {"prompts": prompts}

    def serve(key: str) -> None:
        """Request plane: the leader generates while the follower mirrors its forwards."""
        if leader:
            result[key] = greedy(engine, prompts)
            engine.stop_followers()
        else:
            assert engine.serve_follower() == "stop"

    serve("tp2")
    if leader:
        result["tp1"] = greedy(ReferenceEngine(old_dir, cfg), prompts)
        result["tp2_preemptions"] = engine.stats().preemptions
    # control plane: every rank of the group makes the same calls
    engine.release_memory(["kv_cache", "weights"])
    engine.resume_memory(["kv_cache", "weights"])
    engine.update_weights(iter_safetensors(old_dir))
    serve("tp2_after_resume")
    engine.update_weights(iter_safetensors(new_dir))
    result["max_weight_diff_new"] = engine.max_weight_diff(iter_safetensors(new_dir))
    result["max_weight_diff_old"] = engine.max_weight_diff(iter_safetensors(old_dir))
    serve("tp2_updated")
    engine.shutdown()
    if leader:
        result["tp1_fresh_new"] = greedy(ReferenceEngine(new_dir, cfg), prompts)
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
