"""CPU trainer: fused SDPA core attention vs Megatron's unfused DotProductAttention, same run.

    python -m bench.bench_attention [--prompts 16] [--responses 4] [--steps 4] [--threads 1] [--micro-batch-tokens 4096]

The CPU layer spec computes attention with ``scaled_dot_product_attention``
(``megatron_ext/sdpa_attention.py``); Megatron's local spec materialises the
``[batch, heads, seq, seq]`` scores and probabilities instead. Each step runs
the GRPO forward/backward of the shipped policy on the same micro-batches
(planned as the trainer plans them) with both, in alternating order, on two
workloads: a baseline-like batch (the task's long tail, see
``bench/bench_packing.py``) and a long-round batch (every response 250-450
tokens, what a long round of tail batching trains). The summed losses must agree.
"""
from __future__ import annotations

import contextlib
import random
import time
from functools import partial

from bench.bench_packing import batch, policy_trainer_bench
from megatron_ext.sdpa_attention import megatron_attention
from rollpacker.trainer.packing import plan_micro_batches, sequence_length


def long_round_lengths(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(250, 450) for _ in range(n)]


def main() -> None:
    args, cfg, backend, loss_fn = policy_trainer_bench(__doc__)

    def run(mbs) -> tuple[float, float]:
        backend.zero_grad()
        start = time.perf_counter()
        results = backend.forward_backward(mbs, loss_fn)
        return time.perf_counter() - start, float(sum(r.objective.detach() for r in results))

    workloads = {"baseline-like": batch, "long round": partial(batch, lengths=long_round_lengths)}
    seconds = {(w, m): 0.0 for w in workloads for m in ("megatron", "sdpa")}
    tokens = dict.fromkeys(workloads, 0)
    for step in range(args.steps):
        for name, make in workloads.items():
            samples = make(args.prompts, args.responses, seed=step)
            tokens[name] += sum(sequence_length(s) for s in samples)
            mbs = plan_micro_batches(samples, budget=cfg.micro_batch_tokens, aggregation=cfg.loss_aggregation,
                                     layout=backend.micro_batch_layout, pad_multiple=backend.pad_multiple)
            losses = {}
            for mode in (("megatron", "sdpa") if step % 2 == 0 else ("sdpa", "megatron")):
                with megatron_attention(backend.model) if mode == "megatron" else contextlib.nullcontext():
                    dt, losses[mode] = run(mbs)
                seconds[name, mode] += dt
            if abs(losses["megatron"] - losses["sdpa"]) > 1e-5 * max(1.0, abs(losses["megatron"])):
                raise SystemExit(f"step {step}, {name}: the two attentions gave different losses {losses}")
        print(f"step {step} done", flush=True)
    print(f"\n{args.steps} steps x {args.prompts}x{args.responses} samples, budget {cfg.micro_batch_tokens}, "
          f"{args.threads} thread(s); forward+backward of the shipped policy:")
    print("| workload | tokens | Megatron DotProductAttention | SDPA | ratio |\n|---|---|---|---|---|")
    for name in workloads:
        meg, sdpa = seconds[name, "megatron"], seconds[name, "sdpa"]
        print(f"| {name} | {tokens[name]} | {meg:.2f} s | {sdpa:.2f} s | {meg / sdpa:.2f}× |")


if __name__ == "__main__":
    main()
