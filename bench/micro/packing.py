"""CPU trainer: micro-batches packed by padded cost vs by real tokens, same samples, same run.

    python -m bench.micro.packing [--prompts 16] [--responses 4] [--steps 4] [--threads 1]
                                  [--out bench/results/packing.json]

The CPU backend lays a micro-batch out as right-padded rows, so a micro-batch
costs rows x its longest row. Each step draws a baseline-like batch (P x R
samples, step counts from the built-in task's long tail, 7 tokens a step, so
lengths span 10 to ~450 tokens) and runs the GRPO forward/backward of the
shipped policy's Megatron model on it twice, in alternating order:

* tokens - first-fit decreasing by real tokens under ``trainer.micro_batch_tokens``
  (the THD packing, right for GPUs, where a packed row has no padding);
* padded - the length-sorted rows cut into runs of least padded cost
  (``pack(..., "padded")``, what the CPU backend uses).

Both see the same samples and produce the same summed loss (checked). Each
step's seconds, padded tokens and micro-batches per mode go to ``--out``, from
which ``python -m bench.tools.report`` renders the table in docs/results.md (also printed).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from functools import partial
from typing import Callable

import torch

from bench.tools import report
from bench.tools.results import REPO, write_results
from megatron_ext.parallel import setup_layout
from rollpacker.examples import task
from rollpacker.sample import Prompt, Sample
from testkit import REPO_ROOT
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


def policy_trainer_bench(doc: str, results: str) -> tuple[argparse.Namespace, TrainerConfig, Backend, Callable]:
    """The trainer benchmarks' shared setup: arguments, the shipped policy's CPU backend, the GRPO loss."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--responses", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="configs/tiny-cpu.yaml's budget")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / f"{results}.json"), help="raw results (JSON)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, params_dtype="fp32")
    backend = Trainer(cfg, REPO_ROOT / "assets" / "policy", setup_layout()).backend
    loss_fn = partial(micro_batch_loss, cfg=cfg, tp_group=backend.layout.tp_group, vocab_size=backend.vocab_size)
    return args, cfg, backend, loss_fn


def timed_step(backend: Backend, loss_fn: Callable, mbs: list) -> tuple[float, float]:
    """Seconds of one forward/backward over ``mbs`` and its summed loss."""
    backend.zero_grad()
    start = time.perf_counter()
    results = backend.forward_backward(mbs, loss_fn)
    return time.perf_counter() - start, float(sum(r.objective.detach() for r in results))


def check_same_loss(step: int, what: str, losses: dict[str, float]) -> None:
    a, b = losses.values()
    if abs(a - b) > 1e-5 * max(1.0, abs(a)):
        raise SystemExit(f"step {step}, {what}: the two runs gave different losses {losses}")


def main() -> None:
    args, cfg, backend, loss_fn = policy_trainer_bench(__doc__, "packing")
    steps = []
    for step in range(args.steps):
        samples = batch(args.prompts, args.responses, seed=step)
        lengths = [sequence_length(s) for s in samples]
        row = {"real_tokens": sum(lengths), "longest": max(lengths)}
        for mode in (("tokens", "padded") if step % 2 == 0 else ("padded", "tokens")):
            groups = pack(lengths, cfg.micro_batch_tokens, "thd" if mode == "tokens" else "padded")
            mbs = [build_micro_batch([samples[i] for i in g], aggregation=cfg.loss_aggregation, layout="padded")
                   for g in groups]
            seconds, loss = timed_step(backend, loss_fn, mbs)
            row[mode] = {"seconds": seconds, "loss": loss, "micro_batches": len(mbs),
                         "padded_tokens": sum(mb.input_ids.numel() for mb in mbs)}
        check_same_loss(step, "packing", {m: row[m]["loss"] for m in ("tokens", "padded")})
        steps.append(row)
        print(f"step {step}: {len(samples)} samples, {row['real_tokens']} tokens, longest {row['longest']}", flush=True)
    seconds = {m: sum(r[m]["seconds"] for r in steps) for m in ("tokens", "padded")}
    results = write_results(args.out, {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                       "steps": steps, "ratio": seconds["tokens"] / seconds["padded"]})
    print(report.packing(json.loads(results.read_text())))


if __name__ == "__main__":
    main()
