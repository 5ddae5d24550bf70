"""Tail batching vs the synchronous baseline on the real reference engine (CPU).

    python -m bench.system.rollout [--policy assets/policy] [--cycles 2] [--p0 16] [--r0 4] ...
    python -m bench.system.rollout --history --prompts 128 --epochs 4 --p0 32   # + history-aware tail batching

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

``--replay-median M`` (the parametric long-tail model, median M tokens) or
``--replay-trace FILE`` (a JSONL length trace) makes every response as long
as the trace says, stop tokens ignored (``rollpacker.rollout.replay``): the
scheduler then meets a chosen length distribution, a published trace's shape
for one, on the real engine; the saturated-throughput probe runs unreplayed.

``--history`` adds a third mode, tail batching with ``scheduler.history``, and
``--prompts N --epochs E`` runs E·N/P0 rounds per mode over the first N
training rows, so each prompt comes back E times (the policy is frozen: a
prompt's lengths correlate across epochs only through the policy itself).
Each round's seconds and tokens are attributed to epochs by the share of its
trained prompts from each epoch; printed per epoch: the wasted-token
fraction, seconds per trained prompt, the speedup over the baseline and the
share of the true bound (the baseline's necessary tokens, i.e. those it
trains on, at the saturated throughput). Raw results go to ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.e2e.stats import by_epoch
from bench.tools.results import write_results
from rollpacker.data.dataset import PromptDataset
from rollpacker.reward import RewardConfig, RewardPool
from rollpacker.reward.sink import PoolRewardSink
from rollpacker.rollout.config import ReplayConfig, RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from rollpacker.rollout.replay import LengthReplay, ReplayLengths
from rollpacker.scheduler import LocalFleet, RealClock, RoundKind, RoundResult, Scheduler
from rollpacker.scheduler.config import HistoryConfig, PlannerConfig, SchedulerConfig
from rollpacker.scheduler.round import over_launch


def saturated_throughput(engine: ReferenceEngine, dataset: PromptDataset, requests: int, tokens: int) -> float:
    """Tokens/s with ``requests`` concurrent requests that all decode ``tokens`` tokens (no stop token)."""
    params = SamplingParams(max_new_tokens=tokens)
    prompts = dataset.take(requests)
    engine.submit([GenerationRequest(f"sat{i}", p.input_ids, params) for i, p in enumerate(prompts)])
    start, done = time.monotonic(), 0
    while done < requests:
        done += len(engine.poll(0.0))
    return requests * tokens / (time.monotonic() - start)


MODES = {"baseline": ("baseline", False), "tail_batching": ("tail_batching", False), "history": ("tail_batching", True)}


def make_scheduler(mode: str, args: argparse.Namespace, data: str, tokenizer, rollout: RolloutConfig) -> Scheduler:
    dataset = PromptDataset([data], tokenizer, max_prompt_length=256, seed=args.seed)
    scheduler_mode, history = MODES[mode]
    cfg = SchedulerConfig(mode=scheduler_mode, p0=args.p0, r0=args.r0, eta_p=args.eta, eta_r=args.eta,
                          planner=PlannerConfig(enabled=False),
                          history=HistoryConfig(enabled=history, eta_p_seen=args.eta_p_seen,
                                                eta_r_seen=args.eta_r_seen))
    return Scheduler(cfg, rollout, dataset, rollout_ranks=1, stop_token_ids=[tokenizer.eos_token_id])


def training_split(path: str, rows: int | None) -> str:
    """``path``, or a temporary file of its first ``rows`` lines."""
    if rows is None:
        return path
    lines = Path(path).read_text().splitlines(keepends=True)
    if len(lines) < rows:
        raise SystemExit(f"{path} has {len(lines)} rows, fewer than --prompts {rows}")
    out = Path(tempfile.mkdtemp(prefix="bench_rollout_")) / "train.jsonl"
    out.write_text("".join(lines[:rows]))
    return str(out)


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


def run_round(mode: str, scheduler: Scheduler, engine: RolloutEngine, sink: PoolRewardSink) -> RoundResult:
    result = scheduler.run_round(scheduler.plan_round(), LocalFleet([engine], RealClock(), sink))
    s = result.stats
    busy, exposed = reward_overlap(result)
    result.reward_busy, result.reward_exposed = busy, exposed
    print(f"  {mode:<14}{result.index:>4} {result.kind.value:<9}{s.rollout_seconds:>9.2f}"
          f"{s.bubble_fraction:>8.2f}{s.generated_tokens:>9}{s.wasted_tokens:>9}{s.preemptions:>6}"
          f"{busy:>9.2f}{exposed:>9.2f}", flush=True)
    result.trained = sorted((g[0].prompt.uid, g[0].prompt.epoch) for g in result.groups)
    result.kept = []  # keep only the stats and the trained prompts
    return result


def mean_seconds(results: list[RoundResult], kind: RoundKind | None = None) -> float:
    seconds = [r.stats.round_seconds for r in results if kind is None or r.kind is kind]
    return statistics.fmean(seconds) if seconds else float("nan")


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
    p.add_argument("--history", action="store_true", help="add tail batching with scheduler.history")
    p.add_argument("--eta-p-seen", type=float, default=HistoryConfig.eta_p_seen)
    p.add_argument("--eta-r-seen", type=float, default=HistoryConfig.eta_r_seen)
    p.add_argument("--prompts", type=int, help="train on the first N rows only (several epochs with --epochs)")
    p.add_argument("--epochs", type=int, help="with --prompts: run epochs x prompts / p0 rounds per mode")
    replay = p.add_mutually_exclusive_group()
    replay.add_argument("--replay-median", type=float,
                        help="every response's length from the parametric long-tail model with this median")
    replay.add_argument("--replay-trace", help="every response's length from this JSONL length trace")
    p.add_argument("--out", help="write the raw results here (JSON), e.g. bench/results/rollout_history.json")
    args = p.parse_args()
    if (args.epochs is None) != (args.prompts is None) or (args.epochs and args.epochs * args.prompts % args.p0):
        raise SystemExit("--epochs and --prompts go together, and epochs x prompts must be a multiple of --p0")
    rounds = args.epochs * args.prompts // args.p0 if args.epochs else 5 * args.cycles
    data = training_split(args.data, args.prompts)
    if not (Path(args.policy) / "config.json").is_file():
        raise SystemExit(f"{args.policy} has no config.json: make the policy with "
                         "python -m rollpacker.examples.make_policy")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    rollout = RolloutConfig(max_response_length=args.limit, kv_cache_tokens=args.kv_tokens,
                            max_running_requests=1024)
    engine = ReferenceEngine(args.policy, rollout)
    replay = ReplayConfig(enabled=args.replay_median is not None or args.replay_trace is not None,
                          trace=args.replay_trace, median=args.replay_median or ReplayConfig.median)
    replay.validate()
    racing = LengthReplay(engine, ReplayLengths(replay, args.limit)) if replay.enabled else engine
    concurrency = over_launch(args.eta, args.p0) * over_launch(args.eta, args.r0)
    probe = PromptDataset([data], tokenizer, max_prompt_length=256)
    throughputs = [saturated_throughput(engine, probe, concurrency, min(args.limit, 64))]
    print(f"  {'mode':<14}{'round':>4} {'kind':<9}{'rollout s':>9}{'bubble':>8}{'gen tok':>9}{'wasted':>9}{'preempt':>6}"
          f"{'reward s':>9}{'exposed':>9}")
    runs: dict[str, list[RoundResult]] = {mode: [] for mode in MODES if mode != "history" or args.history}
    schedulers = {mode: make_scheduler(mode, args, data, tokenizer, rollout) for mode in runs}
    with RewardPool(RewardConfig(num_workers=1), tokenizer=tokenizer) as pool:
        sink = PoolRewardSink(pool)
        pool.wait_ready(60)
        for i in range(rounds):  # interleaved, in alternating order, so every mode sees the same machine load
            for mode in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                runs[mode].append(run_round(mode, schedulers[mode], racing, sink))
    throughputs.append(saturated_throughput(engine, probe, concurrency, min(args.limit, 64)))
    throughput = statistics.fmean(throughputs)
    print(f"saturated throughput at {concurrency} concurrent requests: "
          f"{' / '.join(f'{t:.0f}' for t in throughputs)} tokens/s (before / after)")
    base = runs["baseline"]
    trained = {mode: sorted(key for r in results for key in r.trained) for mode, results in runs.items()}
    same = {mode: keys == trained["baseline"] for mode, keys in trained.items()}
    print(f"threads {args.threads}, P0 {args.p0}, R0 {args.r0}, eta {args.eta}, limit {args.limit}, "
          f"kv {args.kv_tokens} tokens; trained prompts: "
          + ", ".join(f"{mode} {len(keys)}{'' if same[mode] else ' (a different set)'}" for mode, keys in trained.items()))
    base_s = mean_seconds(base)
    base_total = sum(r.stats.round_seconds for r in base)
    print(f"baseline: {base_s:.2f} s/step, bubble {statistics.fmean(r.stats.bubble_fraction for r in base):.2f}")
    for mode, results in runs.items():
        if mode == "baseline":
            continue
        total = sum(r.stats.round_seconds for r in results)
        print(f"{mode}: {mean_seconds(results):.2f} s/step (short {mean_seconds(results, RoundKind.SHORT):.2f} s, "
              f"long {mean_seconds(results, RoundKind.LONG):.2f} s), "
              f"bubble {statistics.fmean(r.stats.bubble_fraction for r in results):.2f}; speedup: short rounds "
              f"{base_s / mean_seconds(results, RoundKind.SHORT):.2f}x (mean baseline round / mean short round), "
              f"amortized {base_total / total:.2f}x ({base_total:.1f} s / {total:.1f} s over {len(base)} rounds each)")
    tail = runs["tail_batching"]
    busy, exposed = sum(r.reward_busy for r in tail), sum(r.reward_exposed for r in tail)
    print(f"reward overlap (tail batching, scored as responses finish): {busy:.2f} s of scoring, "
          f"{exposed:.2f} s after generation ended: {1 - exposed / busy if busy else 1:.0%} hidden behind rollout")
    necessary = sum(r.stats.batch_tokens for r in base) / throughput
    for mode, results in runs.items():
        total = sum(r.stats.round_seconds for r in results)
        bound = sum(r.stats.generated_tokens for r in results) / throughput
        print(f"{mode}: {total:.1f} s total; bubble-free bound {bound:.1f} s "
              f"(generated tokens / saturated throughput): {bound / total:.0%} of it; true bound "
              f"{necessary:.1f} s (the baseline's tokens at saturation): {necessary / total:.0%}")
    epochs = {mode: by_epoch([([e for _, e in r.trained],
                                {"seconds": r.stats.round_seconds, "generated_tokens": r.stats.generated_tokens,
                                 "wasted_tokens": r.stats.wasted_tokens, "batch_tokens": r.stats.batch_tokens})
                               for r in results]) for mode, results in runs.items()}
    report_epochs(epochs, throughput)
    if args.out:
        payload = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "throughput": throughputs,
                   "same_prompts": same, "epochs": epochs,
                   "rounds": {mode: [{"index": r.index, "kind": r.kind.value, "trained": r.trained,
                                      "reward_busy": r.reward_busy, "reward_exposed": r.reward_exposed,
                                      **vars(r.stats)} for r in results] for mode, results in runs.items()}}
        print(f"raw results: {write_results(args.out, payload)}")


def report_epochs(epochs: dict[str, dict[int, dict[str, float]]], throughput: float) -> None:
    """Per epoch: waste, seconds per trained prompt, speedup over the baseline, share of the true bound."""
    print(f"{'epoch':>5} {'mode':<14}{'trained':>8}{'s/prompt':>10}{'wasted':>8}{'speedup':>9}{'of bound':>9}")
    base = epochs["baseline"]
    for epoch in sorted(base):
        b = base[epoch]
        necessary_s = b["batch_tokens"] / b["trained"] / throughput  # per trained prompt, at saturation
        for mode, rows in epochs.items():
            r = rows.get(epoch)
            if r is None:
                continue
            per_prompt = r["seconds"] / r["trained"]
            print(f"{epoch:>5} {mode:<14}{r['trained']:>8.0f}{per_prompt:>10.3f}"
                  f"{r['wasted_tokens'] / max(1.0, r['generated_tokens']):>8.0%}"
                  f"{b['seconds'] / b['trained'] / per_prompt:>8.2f}x{necessary_s / per_prompt:>9.0%}")


if __name__ == "__main__":
    main()
