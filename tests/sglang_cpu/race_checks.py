"""The deterministic race (``scheduler.race: deterministic``) on the real ``sglang.Engine`` on CPU.

Run by ``host_checks.py`` on rank 0's TP-1 engine, after the backend checks:

- ``progress`` counts come from sglang's stream: they rise while a request decodes, never pass
  what it has generated while unfinished, and a request resumed with tokens starts at their count;
- whole short rounds of the scheduler over the engine, with length replay (so that every
  response's length is known in advance, which sglang's sampler does not give on CPU: it reads
  the seed only with deterministic inference, a GPU mode): the rounds keep exactly the groups an
  oracle computes from the replayed lengths, and a second run whose scores come back after
  random delays keeps the same groups with the same responses, so the ledger does not depend on
  the machine's timing.
"""
from __future__ import annotations

import time

# Long enough that the reads below see the counts rise: at 48 tokens a CI run under full load read a
# request once, after 47 of its tokens (sglang decodes this policy at ~175 tokens/s alone on CPU,
# so 512 take seconds, while a read takes milliseconds)
TOKENS = 512
ROUNDS, P0, R0, LIMIT = 3, 4, 2, 32


def progress_counts(eng, prompts) -> dict:
    """Submit streamed requests (one resumed from 5 tokens) and read ``progress`` until they end."""
    from rollpacker.rollout.engine import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=TOKENS, seed=1)
    resume = list(prompts[1][:5])
    requests = [GenerationRequest("prog-0", prompts[0], params, report_progress=True),
                GenerationRequest("prog-1", prompts[1], params, resume_ids=resume, resume_logprobs=[-1.0] * 5,
                                  report_progress=True)]
    eng.submit(requests)
    seen: dict[str, list[int]] = {r.request_id: [] for r in requests}
    first = eng.progress(["prog-1"])[0]
    done: dict = {}
    deadline = time.monotonic() + 120
    while len(done) < len(requests) and time.monotonic() < deadline:
        running = [rid for rid in seen if rid not in done]
        for rid, n in zip(running, eng.progress(running)):
            seen[rid].append(n)
        done.update((c.request_id, c) for c in eng.poll(timeout=0.02))
    unstreamed = GenerationRequest("plain-0", prompts[0], SamplingParams(max_new_tokens=4))
    eng.submit([unstreamed])
    try:
        eng.progress(["plain-0"])
        refused = "progress answered for a request not submitted with report_progress"
    except KeyError:
        refused = True
    while eng.active_request_ids():
        eng.poll(timeout=1.0)
    verdict = {"progress_streamed_counts": {rid: counts[::4] for rid, counts in seen.items()}}
    if len(done) < len(requests):
        verdict["progress_requests_finish"] = f"only {sorted(done)} finished within 120 s"
        return verdict
    verdict["progress_requests_finish"] = True
    verdict["progress_rises_while_decoding"] = all(
        counts == sorted(counts) and len(set(counts)) > 2 for counts in seen.values()) or seen
    verdict["progress_never_reaches_the_final_length"] = all(
        max(counts) < len(done[rid].output_ids) for rid, counts in seen.items()) or {
        rid: (max(counts), len(done[rid].output_ids)) for rid, counts in seen.items()}
    verdict["progress_of_a_resumed_request_starts_at_its_tokens"] = first >= 5 or first
    verdict["progress_refused_for_unstreamed_requests"] = refused
    return verdict


def race_checks(eng, prompts) -> dict:
    from bench.gpu.race_checks import race_rounds
    from rollpacker.rollout.config import ReplayConfig, RolloutConfig
    from rollpacker.rollout.engine import GenerationRequest
    from rollpacker.rollout.replay import LengthReplay, ReplayLengths
    from rollpacker.sample import Prompt
    from rollpacker.scheduler.group_race import GroupLaunch

    verdict = progress_counts(eng, prompts)
    rollout = RolloutConfig(backend="sglang", max_response_length=LIMIT, temperature=1.0,
                            length_replay=ReplayConfig(enabled=True, median=10, seed=5))
    lengths = ReplayLengths(rollout.length_replay, LIMIT)
    replayed = LengthReplay(eng, lengths)
    race_prompts = [Prompt(uid=i, input_ids=[(7 * i + j) % 190 + 3 for j in range(4 + i % 5)], data_source="t")
                    for i in range(16)]
    oracle = []

    def kept_by_lengths(scheduler, plan) -> None:
        """The P0 groups of least mark (the R0-th shortest replayed length, ties by the seeded key),
        in launch order, each with its R0 shortest responses."""
        marks = {}
        for p in plan.prompts:
            prefix = f"p{p.uid}e{p.epoch}r"  # as Scheduler.run_round launches it
            g = GroupLaunch(0, p, plan.n_responses, R0, prefix, f"{scheduler.sampling.seed or 0}:{plan.index}:{prefix}",
                            scheduler.sampling)
            by_length = sorted((min(LIMIT, lengths(GenerationRequest(g.request_id(r), p.input_ids,
                                                                     g.params.with_seed(g.seed(r))))), r)
                               for r in range(g.n))
            marks[(p.uid, p.epoch)] = ((by_length[R0 - 1][0], g.tie), sorted(r for _, r in by_length[:R0]))
        least = set(sorted(marks, key=lambda k: marks[k][0])[:P0])
        oracle.append([(*k, marks[k][1]) for k in ((p.uid, p.epoch) for p in plan.prompts) if k in least])

    quiet, _ = race_rounds(replayed, rollout, race_prompts, rounds=ROUNDS, p0=P0, r0=R0, sink_seed=None,
                           before=kept_by_lengths)
    noisy, _ = race_rounds(replayed, rollout, race_prompts, rounds=ROUNDS, p0=P0, r0=R0, sink_seed=11)
    verdict["race_ledger"] = quiet
    kept = [[tuple(g) for g in groups] for groups, _ in quiet]
    verdict["race_keeps_the_oracles_groups"] = kept == [[tuple(g) for g in o] for o in oracle] or {
        "kept": quiet, "oracle": oracle}
    verdict["race_same_ledger_with_delayed_scores"] = quiet == noisy or {"quiet": quiet, "delayed": noisy}
    return verdict
