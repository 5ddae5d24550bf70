"""Measure the planner's profile table on this machine: one engine's decode tokens/s at each rollout TP.

    torchrun --nproc_per_node 2 -m bench.system.profile_tp [--config configs/tiny-cpu.yaml] [--requests 64]

Every rank takes part, laid out as the program lays engines out: at TP t the
world is cut into world/t engines over explicit groups (gloo on CPU), all
generating at once, each with ``--requests`` random prompts of fixed length
(EOS off, so every TP does the same work). A row's throughput is the mean over
the engines. The KV capacity is the config's ``rollout.kv_cache_tokens``: the
reference engine holds that many tokens per engine at any TP. Rank 0 prints
the rows as YAML for ``scheduler.planner.profile`` and, with ``--json``,
writes them to a file. The ratio line says what the planner will conclude:
TP t pays when one TP-t engine beats t TP-1 engines.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rollpacker.config import load_config
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine


def _tokens_per_s(engine: ReferenceEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Leader: generate and time; followers: mirror the leader's forwards."""
    if not engine.is_leader:
        engine.serve_follower()
        return 0.0
    engine.submit([GenerationRequest(f"p{i}", p, SamplingParams(max_new_tokens=new_tokens, seed=i))
                   for i, p in enumerate(prompts)])
    start = time.perf_counter()
    while engine.active_request_ids():
        engine.poll(None)
    rate = engine.stats().tokens_generated / (time.perf_counter() - start)
    engine.stop_followers()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--requests", type=int, default=64, help="concurrent requests per engine")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = load_config(args.config)
    torch.set_num_threads(cfg.run.threads_per_rank)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = json.loads((Path(cfg.model.path) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    rows = []
    tp = 1
    while tp <= world:
        groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]  # collective, all ranks
        engine = ReferenceEngine(cfg.model.path, cfg.rollout, group=groups[rank // tp] if tp > 1 else None,
                                 engine_id=rank // tp)
        _tokens_per_s(engine, prompts, args.new_tokens)  # warm-up: allocators, first-touch of the KV pool
        rate = torch.tensor([_tokens_per_s(engine, prompts, args.new_tokens)], dtype=torch.float64)
        dist.all_reduce(rate)  # followers contribute 0: the sum over leaders
        rows.append({"tp": tp, "decode_tokens_per_s": round(float(rate) / (world // tp), 1),
                     "kv_capacity_tokens": cfg.rollout.kv_cache_tokens})
        del engine
        tp *= 2
    if rank == 0:
        print(f"# {args.requests} requests x {args.new_tokens} tokens per engine, {world} ranks, "
              f"{cfg.run.threads_per_rank} thread(s) each\nprofile:")
        for r in rows:
            print(f"  - {{tp: {r['tp']}, decode_tokens_per_s: {r['decode_tokens_per_s']}, "
                  f"kv_capacity_tokens: {r['kv_capacity_tokens']}}}")
        base = rows[0]["decode_tokens_per_s"]
        for r in rows[1:]:
            ratio = r["decode_tokens_per_s"] / (r["tp"] * base)
            print(f"# TP {r['tp']}: one engine = {ratio:.2f}x the throughput of the {r['tp']} TP-1 engines it "
                  f"replaces ({'pays' if ratio > 1 else 'does not pay'} unless TP 1 runs out of KV)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
