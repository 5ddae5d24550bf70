"""Measure the planner's profile table on this machine: one engine's decode tokens/s at each rollout layout.

    torchrun --nproc_per_node 2 -m bench.system.profile_tp [--config configs/tiny-cpu.yaml] [--requests 64]
        [--model DIR | --random-moe] [--json FILE]

``--random-moe``: a random Qwen3-MoE made for the run, every layer sparse, 64 experts of which each
token takes 8, as Qwen3-30B-A3B routes (128 experts, top 8) at CPU widths (``RANDOM_MOE``);
bench/results/profile_tp_moe.json is its run.

Every rank takes part, laid out as the program lays engines out: at TP t the
world is cut into world/t engines over explicit groups (gloo on CPU), all
generating at once, each with ``--requests`` random prompts of fixed length
(EOS off, so every layout does the same work). For a MoE model each TP is
measured at every expert-parallel size that divides it and the experts
(``ep``: the experts in ep blocks of whole experts over the engine's ranks).
A row's throughput is the mean over the engines; ``request_tokens_per_s`` is
one request decoding alone on each engine, the speed a long round's few
responses cannot beat. The KV capacity is the config's
``rollout.kv_cache_tokens``: the reference engine holds that many tokens per
engine at any TP. Rank 0 prints the rows as YAML for
``scheduler.planner.profile`` and, with ``--json``, writes them (with the
command and commit) to a results file. The ratio lines say what the planner
will conclude: TP t pays when one TP-t engine beats t TP-1 engines, and EP e
pays in a round of many requests when its row beats EP 1's at the same TP.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.tools.results import write_results
from testkit import make_random_qwen3_moe
from rollpacker.config import Config, load_config
from rollpacker.hf_spec import ModelSpec, parse_spec
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine


RANDOM_MOE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_local_experts=64, num_experts_per_tok=8, moe_intermediate_size=128, mlp_only_layers=[])


def _tokens_per_s(engine: ReferenceEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Leader: generate and time; followers: mirror the leader's forwards."""
    if not engine.is_leader:
        engine.serve_follower()
        return 0.0
    before = engine.stats().tokens_generated
    engine.submit([GenerationRequest(f"p{i}", p, SamplingParams(max_new_tokens=new_tokens, seed=i))
                   for i, p in enumerate(prompts)])
    start = time.perf_counter()
    while engine.active_request_ids():
        engine.poll(None)
    rate = (engine.stats().tokens_generated - before) / (time.perf_counter() - start)
    engine.stop_followers()
    return rate


def _mean_over_engines(engine: ReferenceEngine, prompts: list[list[int]], new_tokens: int, engines: int) -> float:
    rate = torch.tensor([_tokens_per_s(engine, prompts, new_tokens)], dtype=torch.float64)
    dist.all_reduce(rate)  # followers contribute 0: the sum over leaders
    return round(float(rate) / engines, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", default=None, help="an HF model directory instead of the config's model.path")
    what.add_argument("--random-moe", action="store_true", help="a random Qwen3-MoE (RANDOM_MOE) made for the run")
    p.add_argument("--requests", type=int, default=64, help="concurrent requests per engine")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_moe:  # rank 0's copy: every rank of this bench shares the host
            box = [str(Path(tmp) / "moe")]
            if rank == 0:
                make_random_qwen3_moe(box[0], seed=0, **RANDOM_MOE)
            dist.broadcast_object_list(box, src=0)
            args.model = box[0]
        cfg = load_config(args.config, [f"model.path={args.model}"] if args.model else [])
        rows, spec = _measure(args, cfg)
        dist.barrier()  # no rank leaves (and removes the random model) while another still reads it
    if rank == 0:
        _report(args, rows, spec, world, cfg.run.threads_per_rank)
    dist.destroy_process_group()


def _measure(args: argparse.Namespace, cfg: Config) -> tuple[list[dict], ModelSpec]:
    torch.set_num_threads(cfg.run.threads_per_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse_spec(json.loads((Path(cfg.model.path) / "config.json").read_text()))
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(0, spec.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    rows = []
    tp = 1
    while tp <= world:
        groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]  # collective, all ranks
        eps = [e for e in (1 << k for k in range(tp.bit_length())) if spec.is_moe and spec.num_experts % e == 0] or [1]
        for ep in eps:
            engine = ReferenceEngine(cfg.model.path, cfg.rollout, group=groups[rank // tp] if tp > 1 else None,
                                     engine_id=rank // tp, ep=ep)
            _tokens_per_s(engine, prompts, args.new_tokens)  # warm-up: allocators, first-touch of the KV pool
            row = {"tp": tp, **({"ep": ep} if spec.is_moe else {}),
                   "decode_tokens_per_s": _mean_over_engines(engine, prompts, args.new_tokens, world // tp),
                   "kv_capacity_tokens": cfg.rollout.kv_cache_tokens,
                   "request_tokens_per_s": _mean_over_engines(engine, prompts[:1], args.new_tokens, world // tp)}
            rows.append(row)
            del engine
        tp *= 2
    return rows, spec


def _report(args: argparse.Namespace, rows: list[dict], spec: ModelSpec, world: int, threads: int) -> None:
    print(f"# {args.requests} requests x {args.new_tokens} tokens per engine, {world} ranks, "
          f"{threads} thread(s) each\nprofile:")
    for r in rows:
        print("  - {" + ", ".join(f"{k}: {v}" for k, v in r.items()) + "}")
    base = rows[0]
    for r in rows[1:]:
        ratio = r["decode_tokens_per_s"] / (r["tp"] * base["decode_tokens_per_s"])
        print(f"# TP {r['tp']} EP {r.get('ep', 1)}: one engine = {ratio:.2f}x the throughput of the {r['tp']} "
              f"TP-1 engines it replaces ({'pays' if ratio > 1 else 'does not pay'} unless TP 1 runs out of KV); "
              f"one request alone {r['request_tokens_per_s'] / base['request_tokens_per_s']:.2f}x as fast")
    for r in rows:
        if r.get("ep", 1) > 1:
            same = next(x for x in rows if x["tp"] == r["tp"] and x["ep"] == 1)
            print(f"# TP {r['tp']}: EP {r['ep']} / EP 1 = {r['decode_tokens_per_s'] / same['decode_tokens_per_s']:.2f}x "
                  f"saturated, {r['request_tokens_per_s'] / same['request_tokens_per_s']:.2f}x alone")
    if args.json:
        write_results(args.json, {"model": spec.model_type, "widths": RANDOM_MOE if args.random_moe else None,
                                  "ranks": world, "requests": args.requests, "new_tokens": args.new_tokens,
                                  "prompt_len": args.prompt_len, "rows": rows})


if __name__ == "__main__":
    main()
