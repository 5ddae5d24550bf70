"""The deterministic race (``scheduler.race: deterministic``) over SGLang: the groups a run keeps.

``race_rounds`` runs whole short rounds of the scheduler over one engine, its scores coming back
at once or after random delays, and returns their ledger: per round the kept groups as (prompt
uid, epoch, response indices) and the deferred uids, with a checksum of each kept response's
tokens. Used by tests/sglang_cpu/race_checks.py (the real engine on CPU, where sglang's sampler
ignores the seed: lengths are replayed and an oracle computes the kept groups) and by
``check_race_ledger``, a GPU acceptance check: sglang with deterministic inference, whose sampler
reads each request's seed, so that two runs under different timing must keep the same groups (and,
as far as its kernels are batch-invariant, the same tokens).
"""
from __future__ import annotations

import array
import concurrent.futures
import json
import random
import time
import zlib
from typing import Any

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import RolloutEngine
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource, LocalFleet, RealClock, RoundKind, Scheduler
from rollpacker.scheduler.config import PlannerConfig, SchedulerConfig
from rollpacker.scheduler.round_runner import RoundPlan
from rollpacker.sim.reward import SimScore

Ledger = list[tuple[list[tuple[int, int, list[int]]], list[int]]]


class DelayedScores:
    """The reward sink: scores on a thread pool, after a random delay when seeded."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, seed: int | None) -> None:
        self.pool, self.rng = pool, None if seed is None else random.Random(seed)

    def submit(self, sample, *, key=None, adapt=True):
        delay = 0.0 if self.rng is None else self.rng.uniform(0, 0.05)
        return self.pool.submit(lambda: (time.sleep(delay), SimScore(float(len(sample.response_ids) % 2), None))[1])


def race_rounds(engine: RolloutEngine, rollout: RolloutConfig, prompts: list[Prompt], *, rounds: int, p0: int,
                r0: int, sink_seed: int | None, stop_token_ids: tuple[int, ...] = (),
                before: Any = None) -> tuple[Ledger, list[list[int]]]:
    """``rounds`` short rounds (the long rounds between them run too, unrecorded): the ledger and the
    tokens' crc32 per kept response. ``before(scheduler, plan)``, if given, sees each short round's
    plan before it runs (an oracle's hook)."""
    scheduler = Scheduler(SchedulerConfig(p0=p0, r0=r0, race="deterministic", planner=PlannerConfig(enabled=False)),
                          rollout, ListPromptSource(prompts), rollout_ranks=1, stop_token_ids=stop_token_ids)
    ledger: Ledger = []
    tokens: list[list[int]] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sink = DelayedScores(pool, sink_seed)
        while len(ledger) < rounds:
            plan: RoundPlan = scheduler.plan_round()
            if plan.kind is RoundKind.SHORT and before is not None:
                before(scheduler, plan)
            result = scheduler.run_round(plan, LocalFleet([engine], RealClock(), sink))
            if plan.kind is not RoundKind.SHORT:
                continue
            ledger.append(([(g[0].prompt.uid, g[0].prompt.epoch, [s.response_index for s in g]) for g in result.groups],
                           sorted(p.uid for p in result.deferred)))
            tokens.append([zlib.crc32(array.array("i", s.response_ids).tobytes()) for g in result.groups for s in g])
    return ledger, tokens


def check_race_ledger(subject, rounds: int = 3, p0: int = 8, r0: int = 4, limit: int = 128) -> dict[str, Any]:
    """GPU: one sglang engine with deterministic inference (bf16, the policy's EOS as stop token), the
    deterministic race run twice, scores at once and after random delays: the ledgers must be equal."""
    from rollpacker.rollout.sglang_backend import SGLangEngine
    from testkit import free_base_port

    config = json.loads((subject.model_dir / "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    rng = random.Random(5)
    prompts = [Prompt(uid=i, input_ids=[rng.randrange(vocab) for _ in range(rng.randint(4, 24))], data_source="t")
               for i in range(4 * rounds * p0)]
    cfg = RolloutConfig(backend="sglang", sglang_deterministic_inference=True, max_response_length=limit,
                        temperature=1.0, kv_cache_tokens=8192, sglang_base_port=free_base_port(1),
                        mem_fraction_static=0.3)
    t0 = time.perf_counter()
    engine = SGLangEngine(subject.model_dir, cfg, device=str(subject.device), dtype="bfloat16")
    result: dict[str, Any] = {"start_s": time.perf_counter() - t0}
    try:
        runs = []
        for sink_seed in (None, 11):
            t0 = time.perf_counter()
            runs.append(race_rounds(engine, cfg, prompts, rounds=rounds, p0=p0, r0=r0, sink_seed=sink_seed,
                                    stop_token_ids=(eos,)))
            result.setdefault("run_s", []).append(time.perf_counter() - t0)
    finally:
        engine.shutdown()
    (quiet, quiet_tokens), (delayed, delayed_tokens) = runs
    result.update(ledger=quiet, same_ledger=quiet == delayed, same_tokens=quiet_tokens == delayed_tokens,
                  responses=sum(len(t) for t in quiet_tokens),
                  equal_responses=sum(a == b for x, y in zip(quiet_tokens, delayed_tokens) for a, b in zip(x, y)))
    result["ok"] = result["same_ledger"]
    return result
