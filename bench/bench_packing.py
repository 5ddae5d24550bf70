"""CPU trainer: micro-batches packed by padded cost vs by real tokens, same samples, same run.

    python -m bench.bench_packing [--prompts 16] [--responses 4] [--steps 4] [--threads 1]

The CPU backend lays a micro-batch out as right-padded rows, so a micro-batch
costs rows x its longest row. Each step draws a baseline-like batch (P x R
samples, step counts from the built-in task's long tail, 7 tokens a step, so
lengths span 10 to ~450 tokens) and runs the GRPO forward/backward of the
shipped policy's Megatron model on it twice, in alternating order:

* tokens - first-fit decreasing by real tokens under ``trainer.micro_batch_tokens``
  (the THD packing, right for GPUs, where a packed row has no padding);
* padded - the length-sorted rows cut into runs of least padded cost
  (``pack(..., "padded")``, what the CPU backend uses).

Both see the same samples and produce the same summed loss (checked); printed:
seconds, padded tokens and micro-batches per mode, and the ratio.
"""
from __future__ import annotations

import argparse
import random
import time
from functools import partial
from typing import Callable

import torch

from megatron_ext.parallel import setup_layout
from rollpacker.examples import task
from rollpacker.sample import Prompt, Sample
from rollpacker.testing import REPO_ROOT
from rollpacker.trainer.backend import Backend, micro_batch_loss
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.packing import build_micro_batch, pack, sequence_length
from rollpacker.trainer.stream import with_advantages
from rollpacker.trainer.trainer import Trainer


def task_tail_lengths(rng: random.Random, n: int) -> list[int]:
    """A group's response lengths under the built-in task's long tail (7 tokens a step)."""
    steps = task.sample_num_steps(rng)
    return [7 * steps + 4 + rng.randint(0, 6) for _ in range(n)]


def batch(prompts: int, responses: int, seed: int,
          lengths: Callable[[random.Random, int], list[int]] = task_tail_lengths) -> list[Sample]:
    """``prompts`` groups of ``responses`` random-token samples with GRPO advantages."""
    rng = random.Random(seed)
    out = []
    for uid in range(prompts):
        prompt = Prompt(uid=uid, input_ids=[rng.randrange(3, 250) for _ in range(rng.randint(30, 50))],
                        data_source="bench")
        group = [Sample(prompt=prompt, response_index=i, reward=float(rng.random() < 0.5), finish_reason="stop",
                        response_ids=[rng.randrange(3, 250) for _ in range(n)])
                 for i, n in enumerate(lengths(rng, responses))]
        out += with_advantages(group, TrainerConfig())
    return out


def policy_trainer_bench(doc: str) -> tuple[argparse.Namespace, TrainerConfig, Backend, Callable]:
    """The trainer benchmarks' shared setup: arguments, the shipped policy's CPU backend, the GRPO loss."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--responses", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="configs/tiny-cpu.yaml's budget")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, params_dtype="fp32")
    backend = Trainer(cfg, REPO_ROOT / "assets" / "policy", setup_layout()).backend
    loss_fn = partial(micro_batch_loss, cfg=cfg, tp_group=backend.layout.tp_group, vocab_size=backend.vocab_size)
    return args, cfg, backend, loss_fn


def main() -> None:
    args, cfg, backend, loss_fn = policy_trainer_bench(__doc__)
    totals = {m: {"s": 0.0, "padded": 0, "micro_batches": 0} for m in ("tokens", "padded")}
    real = 0
    for step in range(args.steps):
        samples = batch(args.prompts, args.responses, seed=step)
        lengths = [sequence_length(s) for s in samples]
        real += sum(lengths)
        losses = {}
        for mode in (("tokens", "padded") if step % 2 == 0 else ("padded", "tokens")):
            groups = pack(lengths, cfg.micro_batch_tokens, "thd" if mode == "tokens" else "padded")
            mbs = [build_micro_batch([samples[i] for i in g], aggregation=cfg.loss_aggregation, layout="padded")
                   for g in groups]
            backend.zero_grad()
            start = time.perf_counter()
            results = backend.forward_backward(mbs, loss_fn)
            totals[mode]["s"] += time.perf_counter() - start
            totals[mode]["padded"] += sum(mb.input_ids.numel() for mb in mbs)
            totals[mode]["micro_batches"] += len(mbs)
            losses[mode] = float(sum(r.objective.detach() for r in results))
        if abs(losses["tokens"] - losses["padded"]) > 1e-5 * max(1.0, abs(losses["tokens"])):
            raise SystemExit(f"step {step}: the two packings gave different losses {losses}")
        print(f"step {step}: {len(samples)} samples, {sum(lengths)} tokens, longest {max(lengths)}", flush=True)
    print(f"\n{args.steps} steps x {args.prompts}x{args.responses} samples, {real} real tokens, "
          f"budget {cfg.micro_batch_tokens}, {args.threads} thread(s); forward+backward of the shipped policy:")
    for mode, t in totals.items():
        print(f"  {mode:7s} {t['s']:7.2f} s  padded tokens {t['padded']:7d} ({t['padded'] / real:.2f}x real)  "
              f"micro-batches {t['micro_batches']}")
    print(f"ratio (tokens / padded): {totals['tokens']['s'] / totals['padded']['s']:.2f}x")


if __name__ == "__main__":
    main()
