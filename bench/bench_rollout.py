"""Tail batching vs the synchronous baseline on the real reference engine (CPU).

    python -m bench.bench_rollout [--policy assets/policy] [--cycles 2] [--p0 16] [--r0 4] ...

One ``ReferenceEngine`` serves the shipped policy; the real ``RewardPool``
scores every response as it finishes (asynchronous reward). The same
scheduler runs ``5 x cycles`` rounds in baseline mode and in tail-batching
mode (a cycle: 4 short + 1 long round at eta 1.25), the two modes' rounds
interleaved so that both see the same load on a shared machine; both train
exactly the same prompts, the first ``5 x cycles x P0`` of the data order.

Printed: per-round rollout seconds, bubble fraction and generated tokens;
the mean short-round speedup (mean baseline round / mean short round) and the
amortized speedup (total baseline seconds / total tail-batching seconds over
the same rounds, which train the same prompts: checked and printed); and each mode's distance from
the bubble-free bound = the tokens it generated / the engine's saturated
throughput (the mean of a measurement before and one after the rounds, with
every request of a short round's concurrency decoding 64 tokens, no stop).
It also prints how much of the reward scoring (rewards scored as responses
finish) was hidden behind generation in the tail-batching rounds.
Sampling is seeded, so every run generates the same tokens round by round;
only the seconds move with the load other processes put on the machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from rollpacker.data.dataset import PromptDataset
from rollpacker.reward import RewardConfig, RewardPool
from rollpacker.reward.sink import PoolRewardSink
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from rollpacker.scheduler import RealClock, RoundKind, RoundResult, Scheduler
from rollpacker.scheduler.config import PlannerConfig, SchedulerConfig
from rollpacker.scheduler.modes.base import over_launch


def saturated_throughput(engine: ReferenceEngine, dataset: PromptDataset, requests: int, tokens: int) -> float:
    """Tokens/s with ``requests`` concurrent requests that all decode ``tokens`` tokens (no stop token)."""
    params = SamplingParams(max_new_tokens=tokens)
    prompts = dataset.take(requests)
    engine.submit([GenerationRequest(f"sat{i}", p.input_ids, params) for i, p in enumerate(prompts)])
    start, done = time.monotonic(), 0
    while done < requests:
        done += len(engine.poll(0.0))
    return requests * tokens / (time.monotonic() - start)


def make_scheduler(mode: str, args: argparse.Namespace, tokenizer, rollout: RolloutConfig) -> Scheduler:
    dataset = PromptDataset([args.data], tokenizer, max_prompt_length=256, seed=args.seed)
    cfg = SchedulerConfig(mode=mode, p0=args.p0, r0=args.r0, eta_p=args.eta, eta_r=args.eta,
                          planner=PlannerConfig(enabled=False))
    return Scheduler(cfg, rollout, dataset, rollout_ranks=1, stop_token_ids=[tokenizer.eos_token_id])


def reward_overlap(result: RoundResult) -> tuple[float, float]:
    """(seconds some kept response was being scored, seconds of that after the last one was generated).

    With asynchronous reward only the scoring of the last kept responses can
    outlast generation; everything else runs while the engine still decodes.
    """
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((s.finished_at, s.scored_at) for s in result.samples):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    generated = max(s.finished_at for s in result.samples)
    return busy, max(0.0, end - generated)


def run_round(mode: str, scheduler: Scheduler, engine: ReferenceEngine, sink: PoolRewardSink) -> RoundResult:
    result = scheduler.run_round(scheduler.plan_round(), [engine], sink, clock=RealClock())
    s = result.stats
    busy, exposed = reward_overlap(result)
    result.reward_busy, result.reward_exposed = busy, exposed
    print(f"  {mode:<14}{result.index:>4} {result.kind.value:<9}{s.rollout_seconds:>9.2f}"
          f"{s.bubble_fraction:>8.2f}{s.generated_tokens:>9}{s.wasted_tokens:>9}{s.preemptions:>6}"
          f"{busy:>9.2f}{exposed:>9.2f}", flush=True)
    result.trained = sorted(g[0].prompt.uid for g in result.groups)
    result.groups = []  # keep only the stats and the trained prompts
    return result


def mean_seconds(results: list[RoundResult], kind: RoundKind | None = None) -> float:
    return statistics.fmean(r.stats.round_seconds for r in results if kind is None or r.kind is kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="assets/policy")
    p.add_argument("--data", default="assets/data/train.jsonl")
    p.add_argument("--p0", type=int, default=8)
    p.add_argument("--r0", type=int, default=4)
    p.add_argument("--eta", type=float, default=1.25)
    p.add_argument("--limit", type=int, default=512, help="max response length")
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                   help="torch intra-op threads (default: $OMP_NUM_THREADS, else 1). On cores shared with other "
                        "jobs, 2 threads on 2 cores can make a round 10-20x slower (threads spin at barriers)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if not (Path(args.policy) / "config.json").is_file():
        raise SystemExit(f"{args.policy} has no config.json: make the policy with "
                         "python -m rollpacker.examples.make_policy")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    rollout = RolloutConfig(max_response_length=args.limit, kv_cache_tokens=args.kv_tokens,
                            max_running_requests=1024)
    engine = ReferenceEngine(args.policy, rollout)
    concurrency = over_launch(args.eta, args.p0) * over_launch(args.eta, args.r0)
    probe = PromptDataset([args.data], tokenizer, max_prompt_length=256)
    throughputs = [saturated_throughput(engine, probe, concurrency, min(args.limit, 64))]
    print(f"  {'mode':<14}{'round':>4} {'kind':<9}{'rollout s':>9}{'bubble':>8}{'gen tok':>9}{'wasted':>9}{'preempt':>6}"
          f"{'reward s':>9}{'exposed':>9}")
    runs: dict[str, list[RoundResult]] = {"baseline": [], "tail_batching": []}
    schedulers = {mode: make_scheduler(mode, args, tokenizer, rollout) for mode in runs}
    with RewardPool(RewardConfig(num_workers=1)) as pool:
        sink = PoolRewardSink(pool, tokenizer)
        pool.wait_ready(60)
        for _ in range(5 * args.cycles):  # interleaved, so both modes see the same machine load
            for mode, scheduler in schedulers.items():
                runs[mode].append(run_round(mode, scheduler, engine, sink))
    throughputs.append(saturated_throughput(engine, probe, concurrency, min(args.limit, 64)))
    throughput = statistics.fmean(throughputs)
    print(f"saturated throughput at {concurrency} concurrent requests: "
          f"{' / '.join(f'{t:.0f}' for t in throughputs)} tokens/s (before / after)")
    base, tail = runs["baseline"], runs["tail_batching"]
    trained = {mode: sorted(uid for r in results for uid in r.trained) for mode, results in runs.items()}
    same = trained["baseline"] == trained["tail_batching"]
    print(f"threads {args.threads}, P0 {args.p0}, R0 {args.r0}, eta {args.eta}, limit {args.limit}, "
          f"kv {args.kv_tokens} tokens; both modes trained {len(trained['baseline'])} / "
          f"{len(trained['tail_batching'])} prompts, {'the same set' if same else 'DIFFERENT sets'}")
    base_s = mean_seconds(base)
    print(f"baseline: {base_s:.2f} s/step, bubble {statistics.fmean(r.stats.bubble_fraction for r in base):.2f}")
    print(f"tail batching: {mean_seconds(tail):.2f} s/step (short {mean_seconds(tail, RoundKind.SHORT):.2f} s, "
          f"long {mean_seconds(tail, RoundKind.LONG):.2f} s), "
          f"bubble {statistics.fmean(r.stats.bubble_fraction for r in tail):.2f}")
    base_total, tail_total = (sum(r.stats.round_seconds for r in rs) for rs in (base, tail))
    print(f"speedup: short rounds {base_s / mean_seconds(tail, RoundKind.SHORT):.2f}x (mean baseline round / "
          f"mean short round), amortized over {args.cycles} cycles {base_total / tail_total:.2f}x "
          f"({base_total:.1f} s / {tail_total:.1f} s over {len(base)} rounds each)")
    busy, exposed = sum(r.reward_busy for r in tail), sum(r.reward_exposed for r in tail)
    print(f"reward overlap (tail batching, scored as responses finish): {busy:.2f} s of scoring, "
          f"{exposed:.2f} s after generation ended: {1 - exposed / busy if busy else 1:.0%} hidden behind rollout")
    for mode, results in runs.items():
        total = sum(r.stats.round_seconds for r in results)
        bound = sum(r.stats.generated_tokens for r in results) / throughput
        print(f"{mode}: {total:.1f} s total; bubble-free bound {bound:.1f} s "
              f"(generated tokens / saturated throughput): {bound / total:.0%} of it")


if __name__ == "__main__":
    main()
