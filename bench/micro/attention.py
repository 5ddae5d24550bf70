"""CPU trainer: fused SDPA core attention vs Megatron's unfused DotProductAttention, same run.

    python -m bench.micro.attention [--prompts 16] [--responses 4] [--steps 4] [--threads 1] [--micro-batch-tokens 4096]
                                    [--out bench/results/attention.json]

The CPU layer spec computes attention with ``scaled_dot_product_attention``
(``megatron_ext/sdpa_attention.py``); Megatron's local spec materialises the
``[batch, heads, seq, seq]`` scores and probabilities instead. Each step runs
the GRPO forward/backward of the shipped policy on the same micro-batches
(planned as the trainer plans them) with both, in alternating order, on two
workloads: a baseline-like batch (the task's long tail, see
``bench/micro/packing.py``) and a long-round batch (every response 250-450
tokens, what a long round of tail batching trains). The summed losses must agree.
Each step's seconds go to ``--out``, from which ``python -m bench.tools.report``
renders the table in docs/results.md (also printed).
"""
from __future__ import annotations

import contextlib
import json
import random
from functools import partial

from bench.tools import report
from bench.micro.packing import batch, check_same_loss, policy_trainer_bench, timed_step
from bench.tools.results import write_results
from megatron_ext.sdpa_attention import megatron_attention
from rollpacker.trainer.packing import plan_micro_batches, sequence_length


def long_round_lengths(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(250, 450) for _ in range(n)]


WORKLOADS = {"baseline-like (the task's long tail)": batch,
             "long round (every response 250–450 tokens)": partial(batch, lengths=long_round_lengths)}


def main() -> None:
    args, cfg, backend, loss_fn = policy_trainer_bench(__doc__, "attention")
    steps = []
    for step in range(args.steps):
        row = {}
        for name, make in WORKLOADS.items():
            samples = make(args.prompts, args.responses, seed=step)
            mbs = plan_micro_batches(samples, budget=cfg.micro_batch_tokens, aggregation=cfg.loss_aggregation,
                                     layout=backend.micro_batch_layout, pad_multiple=backend.pad_multiple)
            row[name] = {"tokens": sum(sequence_length(s) for s in samples)}
            for mode in (("megatron", "sdpa") if step % 2 == 0 else ("sdpa", "megatron")):
                with megatron_attention(backend.model) if mode == "megatron" else contextlib.nullcontext():
                    seconds, loss = timed_step(backend, loss_fn, mbs)
                row[name][mode] = {"seconds": seconds, "loss": loss}
            check_same_loss(step, name, {m: row[name][m]["loss"] for m in ("megatron", "sdpa")})
        steps.append(row)
        print(f"step {step} done", flush=True)
    ratio = {name: sum(r[name]["megatron"]["seconds"] for r in steps) / sum(r[name]["sdpa"]["seconds"] for r in steps)
             for name in WORKLOADS}
    results = write_results(args.out, {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                       "steps": steps, "ratio": ratio})
    print(report.attention(json.loads(results.read_text())))


if __name__ == "__main__":
    main()
