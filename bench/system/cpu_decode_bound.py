"""What decode time alone lets tail batching gain on this CPU with the shipped example, beside the program.

    python -m bench.system.cpu_decode_bound [--seeds 4] [--out bench/results/cpu_decode_bound.json]

Three steps, on a quiet machine (the sweep times the engine):
1. The reference engine's decode cost here, as the example's ranks see it: the shipped policy
   (``assets/policy``), one thread as in ``configs/tiny-cpu.yaml``, in as many processes at once as
   the example has ranks (each engine shares the machine with the other); B requests with x-token
   prompts, timed to 1 and to K new tokens (EOS off); a decode step is the difference over K - 1
   steps, at x + K / 2 context, averaged over the processes. Least squares fits
   ``step = a + B (b + c x)`` (``rollpacker.sim.perf.FittedCost``); prefill is timed per token.
2. The example's length trace: the shipped policy on the first prompts of the example's training
   data, R responses each at the example's temperature and length limit, stopping at EOS.
3. The real scheduler over two modeled engines with the fitted cost (the example's 2 ranks, TP 1) on
   that trace, at the settings of ``bench/results/e2e.json`` (P0, R0, steps): baseline vs tail
   batching rollout seconds, over seeds, with no coordinator, reward or transport time. The step's
   other seconds come from the program's own measured steps in ``e2e.json``: (modeled baseline
   rollout + measured rest) / (modeled tail-batching rollout + measured rest) end to end.
   This bounds the gain that decode time allows; the program also spends time outside decoding,
   which tail batching cuts too, so it is no bound on the program's measured gain.

Raw results go to ``--out`` (the trace beside it as JSONL, for ``rollpacker-sim --trace``);
``python -m bench.tools.report`` renders the table in docs/results.md and the README's CPU row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.tools.report import cpu_decode_bound as render
from bench.tools.results import REPO, write_results
from rollpacker.config import load_config
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from rollpacker.sim.perf import FittedCost
from rollpacker.sim.run import SimCluster, SimSettings
from rollpacker.sim.traces import PromptLengths

CONFIG = REPO / "configs" / "tiny-cpu.yaml"
ENGINES = 2  # the example's two ranks, one TP-1 engine each


def timed_generation(engine: ReferenceEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)  # no stop ids: exactly new_tokens
    start = time.perf_counter()
    engine.submit([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    while engine.active_request_ids():
        engine.poll(None)
    return time.perf_counter() - start


def sweep(model: Path, batches: list[int], contexts: list[int], steps: int, repeats: int, vocab: int,
          threads: int = 1) -> list[dict]:
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)  # a spawned process: the caller's inference mode does not reach it
    rows, g = [], torch.Generator().manual_seed(0)
    for batch in batches:
        for context in contexts:
            cfg = RolloutConfig(max_running_requests=batch, kv_cache_tokens=batch * (context + steps + 16),
                                max_prefill_tokens=batch * context)
            engine = ReferenceEngine(model, cfg)
            prompts = [torch.randint(1, vocab, (context,), generator=g).tolist() for _ in range(batch)]
            one = min(timed_generation(engine, prompts, 1) for _ in range(repeats))
            many = min(timed_generation(engine, prompts, steps) for _ in range(repeats))
            rows.append({"batch": batch, "prompt": context, "context": context + steps / 2,
                         "step_s": (many - one) / (steps - 1), "prefill_s": one})
    return rows


def concurrent_sweep(processes: int, *args) -> list[dict]:
    """``sweep`` in ``processes`` processes at once; per point, the mean over them."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        runs = pool.starmap(sweep, [args] * processes)
    rows = []
    for points in zip(*runs):
        row = {**points[0], **{k: statistics.fmean(p[k] for p in points) for k in ("step_s", "prefill_s")}}
        rows.append(row)
        print(f"batch {row['batch']:>3} prompt {row['prompt']:>4}: decode step {1e3 * row['step_s']:.2f} ms, "
              f"prefill {1e3 * row['prefill_s']:.1f} ms ({processes} processes at once)", flush=True)
    return rows


def fit(rows: list[dict], kv_capacity: int) -> tuple[FittedCost, dict]:
    x = np.array([[1.0, r["batch"], r["batch"] * r["context"]] for r in rows])
    y = np.array([r["step_s"] for r in rows])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    prefill = statistics.median(r["prefill_s"] / (r["batch"] * r["prompt"]) for r in rows)
    cost = FittedCost(float(a), float(b), float(c), prefill, kv_capacity)
    errors = [abs(cost.decode_seconds(1, r["batch"], int(r["batch"] * r["context"])) / r["step_s"] - 1) for r in rows]
    return cost, {"step_s": a, "per_request_s": b, "per_context_token_s": c, "prefill_per_token_s": prefill,
                  "kv_capacity_tokens": kv_capacity, "max_relative_error": max(errors),
                  "median_relative_error": statistics.median(errors)}


def example_trace(cfg, prompts: int, responses: int, seed: int) -> list[PromptLengths]:
    from transformers import AutoTokenizer

    from rollpacker.data.dataset import PromptDataset

    model = Path(cfg.model.path)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    data = PromptDataset(cfg.data.train_files, AutoTokenizer.from_pretrained(model),
                         max_prompt_length=cfg.data.max_prompt_length, shuffle=False).take(prompts)
    engine = ReferenceEngine(model, RolloutConfig(kv_cache_tokens=cfg.rollout.kv_cache_tokens))
    params = SamplingParams(temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_response_length,
                            stop_token_ids=tuple(eos if isinstance(eos, list) else [eos]))
    engine.submit([GenerationRequest(f"{i}:{r}", p.input_ids, params.with_seed(seed * 1_000_003 + i * 101 + r))
                   for i, p in enumerate(data) for r in range(responses)])
    lengths: dict[str, int] = {}
    while engine.active_request_ids():
        lengths.update((c.request_id, len(c.output_ids)) for c in engine.poll(None))
    return [PromptLengths(f"example-{p.uid}", tuple(lengths[f"{i}:{r}"] for r in range(responses)), len(p.input_ids))
            for i, p in enumerate(data)]


def modeled_rollouts(trace: list[PromptLengths], cost: FittedCost, p0: int, r0: int, steps: int, limit: int,
                     seed: int) -> dict[str, list[float]]:
    settings = SimSettings(gpus=ENGINES, tp=1, p0=p0, r0=r0, limit=limit, rounds=steps, seed=seed)
    out = {}
    for mode in ("baseline", "tail_batching"):
        cluster = SimCluster(mode, settings, trace, shuffle_seed=seed, cost=lambda tp: cost)
        out[mode] = [cluster.run_round().stats.rollout_seconds for _ in range(steps)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="32,128,384", help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per point")
    p.add_argument("--repeats", type=int, default=2, help="timings per point; the fastest is kept")
    p.add_argument("--trace-prompts", type=int, default=256)
    p.add_argument("--trace-responses", type=int, default=8)
    p.add_argument("--seeds", type=int, default=4, help="scheduler seeds (prompt order and draws)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu_decode_bound.json"))
    args = p.parse_args()
    cfg = load_config(CONFIG)
    torch.set_num_threads(cfg.run.threads_per_rank)
    e2e = json.loads((REPO / "bench" / "results" / "e2e.json").read_text())
    model = Path(cfg.model.path)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = concurrent_sweep(ENGINES, model, [int(b) for b in args.batches.split(",")],
                            [int(c) for c in args.contexts.split(",")], args.steps, args.repeats, vocab,
                            cfg.run.threads_per_rank)
    cost, fitted = fit(rows, cfg.rollout.kv_cache_tokens)
    with torch.inference_mode():
        print(f"fit: {1e3 * fitted['step_s']:.2f} ms + B x ({1e3 * fitted['per_request_s']:.3f} ms + "
              f"{1e6 * fitted['per_context_token_s']:.2f} us x context); error median "
              f"{fitted['median_relative_error']:.1%}, max {fitted['max_relative_error']:.1%}", flush=True)
        trace = example_trace(cfg, args.trace_prompts, args.trace_responses, seed=0)
    trace_path = Path(args.out).with_name("cpu_decode_bound_trace.jsonl")
    trace_path.write_text("".join(json.dumps({"prompt_id": t.prompt_id, "lengths": list(t.lengths),
                                              "prompt_length": t.prompt_length}) + "\n" for t in trace))
    s = e2e["settings"]
    runs = [modeled_rollouts(trace, cost, s["p0"], s["r0"], s["steps"], cfg.rollout.max_response_length, seed)
            for seed in range(args.seeds)]
    measured = {row["key"]: row["summary"] for row in e2e["ablation"]}
    lengths = sorted(x for t in trace for x in t.lengths)
    payload = {"settings": {**vars(args), "config": str(CONFIG.relative_to(REPO)), "engines": ENGINES,
                            "p0": s["p0"], "r0": s["r0"], "steps": s["steps"],
                            "limit": cfg.rollout.max_response_length, "threads": cfg.run.threads_per_rank},
               "sweep": rows, "fit": fitted,
               "trace": {"file": str(trace_path.resolve().relative_to(REPO) if trace_path.resolve().is_relative_to(REPO)
                                     else trace_path), "median": statistics.median(lengths),
                         "mean": statistics.fmean(lengths), "max": lengths[-1],
                         "sigma_log_within_prompt": statistics.fmean(
                             statistics.pstdev(np.log(t.lengths)) for t in trace)},
               "modeled": runs,
               "measured": {key: {k: measured[key][k] for k in ("step_s", "rollout_s", "train_s")}
                            for key in ("baseline", "tail_batching", "stream")},
               "measured_from": {"command": e2e["command"], "commit": e2e["commit"]}}
    results = json.loads(write_results(args.out, payload).read_text())
    print(render(results))
    print(f"raw results: {args.out}; trace: {trace_path}")


if __name__ == "__main__":
    main()
