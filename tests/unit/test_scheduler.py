"""The rollout scheduler over modeled engines on a virtual clock.

Every round here is the real ``Scheduler`` driving real ``SimEngine``s
(continuous batching, KV budget with preemption) and a reward sink with
latency, so completion, scoring and abort interleave as they would live.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import pickle
import random
import weakref
from collections import Counter

import pytest

from rollpacker.configlib import ConfigError
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import FINISH_ABORT, GenerationRequest, SamplingParams
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource, LocalFleet, RoundKind, Scheduler, VirtualClock
from rollpacker.scheduler.config import PlannerConfig, SchedulerConfig
from rollpacker.scheduler.group_race import GroupLaunch
from rollpacker.scheduler.handoff import HandoffPolicy, HandoffTrigger
from rollpacker.scheduler.round_runner import EngineDriver, RoundRunner
from rollpacker.scheduler.round import RoundPlan
from rollpacker.sim import H800, LengthOracle, ModelSpec, PerfModel, SimEngine, SimRewardSink, longtail_trace
from rollpacker.sim.traces import PromptLengths, parse_request_id

TINY = ModelSpec("tiny", 5e8, 8, 1024, 2)


class RecordingEngine(SimEngine):
    """A modeled engine that remembers when requests were aborted or returned."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aborted: dict[str, float] = {}
        self.returned: dict[str, float] = {}
        self.submitted: dict[str, GenerationRequest] = {}

    def submit(self, requests) -> None:
        self.submitted.update((r.request_id, r) for r in requests)
        super().submit(requests)

    def abort(self, request_ids) -> None:
        ids = [rid for rid in request_ids if rid in set(self.active_request_ids())]
        self.aborted.update(dict.fromkeys(ids, self.clock.now()))
        super().abort(ids)

    def poll(self, timeout=0.0):
        done = super().poll(timeout)
        self.returned.update((c.request_id, self.clock.now()) for c in done)
        return done


class RecordingSource(ListPromptSource):
    def __init__(self, prompts, ledger: list) -> None:
        super().__init__(prompts)
        self.ledger = ledger

    def take(self, n):
        out = super().take(n)
        self.ledger.extend((p.uid, p.epoch) for p in out)
        return out


class Harness:
    engine_cls = RecordingEngine

    def __init__(self, mode="tail_batching", *, p0=8, r0=4, eta=1.25, trace=None, num_prompts=40, engines=2,
                 limit=4096, median=None, seed=0, async_reward=True, reward_fn=None, latency=None,
                 kv_capacity=None, planner=False):
        self.clock = VirtualClock()
        self.trace = trace or longtail_trace(num_prompts, samples=8, median=median or limit / 28, limit=limit,
                                                    seed=seed)
        self.oracle = LengthOracle(self.trace, seed=seed)
        self.taken: list[tuple[int, int]] = []
        self.prompts = [Prompt(uid=i, input_ids=[1] * 16, data_source="t") for i in range(len(self.trace))]
        self.engines_n, self.limit, self.kv_capacity = engines, limit, kv_capacity
        self.cfg = SchedulerConfig(mode=mode, p0=p0, r0=r0, eta_p=eta, eta_r=eta,
                                   planner=PlannerConfig(enabled=planner, short_tp=1, long_tp=1, max_tp=engines))
        self.async_reward = async_reward
        self.scheduler = self.new_scheduler()
        self.sink = SimRewardSink(self.clock, reward_fn or (lambda s: 1.0), latency or (lambda s: 0.0))
        self.last_engines: list[RecordingEngine] = []

    def new_scheduler(self) -> Scheduler:
        self.source = RecordingSource(self.prompts, self.taken)
        return Scheduler(self.cfg, RolloutConfig(max_response_length=self.limit), self.source,
                         rollout_ranks=self.engines_n, async_reward=self.async_reward)

    def round(self, on_group_done=None, handoff=None):
        plan = self.scheduler.plan_round()
        perf = PerfModel(TINY, H800, plan.tp)
        self.last_engines = [self.engine_cls(perf, self.clock, self.oracle, engine_id=i,
                                             kv_capacity_tokens=self.kv_capacity and self.kv_capacity * plan.tp)
                             for i in range(self.engines_n // plan.tp)]
        result = self.scheduler.run_round(plan, LocalFleet(self.last_engines, self.clock, self.sink),
                                          on_group_done=on_group_done, handoff=handoff)
        return plan, result

    def aborted(self) -> dict[str, float]:
        return {k: v for e in self.last_engines for k, v in e.aborted.items()}

    def returned(self) -> dict[str, float]:
        return {k: v for e in self.last_engines for k, v in e.returned.items()}


def assert_batch(result, p0, r0, aborted):
    assert len(result.groups) == p0
    for group in result.groups:
        assert len(group) == r0
        assert len({(s.prompt.uid, s.prompt.epoch) for s in group}) == 1
        assert len({s.response_index for s in group}) == r0
        for s in group:
            assert s.finish_reason in ("stop", "length") and s.finish_reason != FINISH_ABORT
            assert s.request_id not in aborted
            assert s.reward is not None and s.scored_at >= s.finished_at >= s.submitted_at
    assert len({(g[0].prompt.uid, g[0].prompt.epoch) for g in result.groups}) == p0


def test_tail_batching_batches_queue_fifo_and_cycle():
    h = Harness(p0=8, r0=4, num_prompts=30, latency=lambda s: 0.01 * (s.response_index + 1))
    kinds = []
    for _ in range(10):
        before = h.scheduler.queue.peek()
        plan, result = h.round()
        kinds.append(plan.kind)
        assert_batch(result, 8, 4, h.aborted())
        launched = plan.prompts
        if plan.kind is RoundKind.LONG:
            assert plan.prompts == tuple(before[:8]) and plan.n_responses == 4
            assert result.deferred == [] and result.stats.launched_responses == 32
            assert not h.aborted()  # no speculation: every response runs to its end
        else:
            assert (len(plan.prompts), plan.n_responses) == (10, 5)
            kept = {(g[0].prompt.uid, g[0].prompt.epoch) for g in result.groups}
            assert result.deferred == [p for p in launched if (p.uid, p.epoch) not in kept]
        assert h.scheduler.queue.peek() == (before[8:] if plan.kind is RoundKind.LONG else before + result.deferred)
    short, long = RoundKind.SHORT, RoundKind.LONG
    assert kinds == [short, short, short, short, long] * 2


def test_extras_are_aborted_when_a_prompt_completes():
    h = Harness(p0=4, r0=2, eta=2.0, num_prompts=12, latency=lambda s: 0.02)
    plan, result = h.round()
    aborted, returned = h.aborted(), h.returned()
    for group in result.groups:
        done_at = max(s.scored_at for s in group)
        p = group[0].prompt
        extras = {f"p{p.uid}e{p.epoch}r{r}" for r in range(plan.n_responses)} - {s.request_id for s in group}
        for rid in extras:  # aborted the moment the group completed, unless it had already finished
            assert aborted.get(rid) == done_at or returned[rid] <= done_at
    close = result.stats.rollout_seconds
    deferred = {(p.uid, p.epoch) for p in result.deferred}
    assert len(deferred) == 4
    for rid, t in aborted.items():
        assert t <= close
    assert all(not e.active_request_ids() for e in h.last_engines)  # the close aborted everything else
    assert result.stats.wasted_tokens == result.stats.generated_tokens - result.stats.batch_tokens > 0


def test_baseline_waits_for_every_response():
    trace = [PromptLengths(str(i), (100, 200, 300, 3000 if i == 3 else 400)) for i in range(8)]
    h = Harness("baseline", p0=4, r0=4, trace=trace, limit=4096)
    plan, result = h.round()
    assert plan.kind is RoundKind.BASELINE and plan.n_responses == 4
    assert_batch(result, 4, 4, h.aborted())
    assert not h.aborted() and result.deferred == [] and result.stats.wasted_tokens == 0
    assert max(s.num_response_tokens for s in result.samples) == 3000
    assert result.stats.rollout_seconds == pytest.approx(max(s.finished_at for s in result.samples))
    assert result.stats.bubble_fraction > 0.5  # one straggler holds the round open


def test_ledger_over_epochs_with_save_restore():
    """Every prompt taken from the source is trained exactly once, filtered, or still queued."""
    rng = random.Random(7)
    accuracy = {i: rng.choice([0.0, 1.0, 0.3, 0.5, 0.7]) for i in range(24)}

    def reward_fn(sample):
        return float(rng.random() < accuracy[sample.prompt.uid])

    for mode in ("tail_batching", "dynamic_sampling"):
        h = Harness(mode, p0=6, r0=3, num_prompts=24, seed=3, reward_fn=reward_fn, kv_capacity=2100, limit=2048, median=300,
                    latency=lambda s: rng.expovariate(20.0), planner=True)
        trained, filtered, tps = [], [], []
        saved = None
        for rnd in range(24):
            if rnd == 10:
                saved = json.loads(json.dumps({"sched": h.scheduler.state_dict(), "src": h.source.state_dict()}))
                snapshot = (list(h.taken), list(trained), list(filtered))
            if rnd == 13:  # crash: rounds 10-12 are lost, resume from the checkpoint
                h.taken[:], trained, filtered = snapshot[0], list(snapshot[1]), list(snapshot[2])
                h.scheduler = h.new_scheduler()
                h.scheduler.load_state_dict(saved["sched"])
                h.source.load_state_dict(saved["src"])
                assert saved["sched"]["queue"]["prompts"]  # mid-cycle: the queue is not empty
                assert h.scheduler.planner.state_dict() == saved["sched"]["planner"]
            plan, result = h.round()
            tps.append(plan.tp)
            assert_batch(result, 6, 3, h.aborted())
            trained += [(g[0].prompt.uid, g[0].prompt.epoch) for g in result.groups]
            filtered += [(p.uid, p.epoch) for p in result.filtered]
            if mode == "dynamic_sampling":
                assert all(len({s.reward for s in g}) > 1 for g in result.groups)
        queued = [(p.uid, p.epoch) for p in h.scheduler.queue.peek()]
        assert max(epoch for _, epoch in h.taken) >= 3  # several epochs
        assert Counter(trained + filtered + queued) == Counter(h.taken)
        assert max(Counter(h.taken).values()) == 1
        assert h.scheduler.counters["filtered"] == len(filtered)
        assert h.scheduler.counters["kept"] == len(trained)
        assert len(set(tps)) > 1, tps  # KV pressure made the planner move TP
        if mode == "dynamic_sampling":
            assert filtered  # the always-right and always-wrong prompts


def test_groups_stream_to_callback_in_completion_order():
    seen = []
    h = Harness(p0=4, r0=2, latency=lambda s: 0.05)
    _, result = h.round(on_group_done=lambda g: seen.append((h.clock.now(), g)))
    assert [g for _, g in seen] == result.kept  # the very groups, still in their travelling form
    times = [t for t, _ in seen]
    assert times == sorted(times) and times[0] < result.stats.rollout_seconds  # streamed during the round


class ShippedEngine(RecordingEngine):
    """Hands its completions over as a remote engine's reach rank 0: pickled and unpickled."""

    def poll(self, timeout=0.0):
        self.shipped = pickle.loads(pickle.dumps(super().poll(timeout)))
        self.received = getattr(self, "received", {}) | {c.request_id: c for c in self.shipped}
        return self.shipped


def test_completions_from_another_process_reach_the_batch_still_packed():
    """Rank 0 makes no Python object per token of a remote engine's response: the tokens arrive as
    packed arrays and the batch holds those very arrays, which the trainer packs like lists."""
    import torch

    from rollpacker.trainer.packing import TOKEN_FIELDS, build_micro_batch

    h = Harness(p0=4, r0=2)
    h.engine_cls = ShippedEngine
    _, result = h.round()
    received = {k: c for e in h.last_engines for k, c in getattr(e, "received", {}).items()}
    for s in result.samples:
        c = received[s.request_id]
        assert s.response_ids is c.output_ids and s.rollout_logprobs is c.logprobs
        assert (s.response_ids.typecode, s.rollout_logprobs.typecode) == ("i", "d") and s.num_response_tokens > 0
    s = result.samples[0].replace(advantage=1.0)
    as_lists = s.replace(response_ids=list(s.response_ids), rollout_logprobs=list(s.rollout_logprobs))
    packed, listed = (build_micro_batch([x], aggregation="seq_mean", layout="padded") for x in (s, as_lists))
    for name in TOKEN_FIELDS:
        torch.testing.assert_close(getattr(packed, name), getattr(listed, name), rtol=0, atol=0, equal_nan=True)
    print(f"{len(result.samples)} samples, {sum(map(len, (x.response_ids for x in result.samples)))} tokens, "
          "all in the arrays they arrived in")


def test_the_collector_is_off_during_a_round_and_collects_its_cycles_after():
    """While a round runs the cyclic collector does not (its passes walked every object the round
    made, again and again); afterwards it runs again: a cycle dropped mid-round is collected. A
    collector someone else switched off stays off."""

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    holder, during = [cycle], []
    del cycle
    h = Harness(p0=4, r0=2)

    def on_group(group):
        during.append(gc.isenabled())
        holder.clear()

    assert gc.isenabled()
    h.round(on_group_done=on_group)
    assert during and not any(during) and gc.isenabled()
    gc.collect()
    assert gone() is None, "a cycle dropped during the round was never collected"
    gc.disable()
    try:
        h.round()
        assert not gc.isenabled(), "the round switched on a collector someone else had switched off"
    finally:
        gc.enable()
    print(f"collector off in all {len(during)} group callbacks of the round")


def test_with_seed_is_replace_of_the_seed():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=9, stop_token_ids=(3,), seed=1)
    q = p.with_seed(42)
    assert q == dataclasses.replace(p, seed=42) and hash(q) == hash(dataclasses.replace(p, seed=42)) and p.seed == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.seed = 3


def test_reward_after_rollout_mode():
    seen = []
    h = Harness(p0=4, r0=2, async_reward=False, latency=lambda s: 0.5)
    _, result = h.round(on_group_done=seen.append)
    assert_batch(result, 4, 2, h.aborted())
    assert result.stats.reward_seconds == pytest.approx(0.5)
    assert all(s.scored_at == pytest.approx(result.stats.round_seconds) for s in result.samples)
    assert seen == result.kept
    # every response finishes in the same poll: still exactly P0 groups, the rest deferred
    h = Harness(p0=4, r0=2, async_reward=False, trace=[PromptLengths(str(i), (50,) * 3) for i in range(10)])
    _, result = h.round()
    assert_batch(result, 4, 2, h.aborted())
    assert len(result.deferred) == 1 and result.stats.kept_prompts == 4
    with pytest.raises(ConfigError, match="async"):
        Harness("dynamic_sampling", async_reward=False)


def test_equal_lengths_give_no_speedup():
    trace = [PromptLengths(str(i), (800,) * 5) for i in range(40)]
    seconds = {}
    for mode in ("baseline", "tail_batching"):
        h = Harness(mode, p0=8, r0=4, trace=trace, limit=1024)
        seconds[mode] = sum(h.round()[1].stats.round_seconds for _ in range(5))
    assert seconds["baseline"] / seconds["tail_batching"] == pytest.approx(1.0, abs=0.1)


def test_dispatch_races_a_group_on_one_engine_and_spreads_one_that_does_not_race():
    """A group whose responses race (r0 of more) goes whole to the least loaded engine, which races
    it; one whose responses all count goes a response per engine and comes back joined. Groups go
    where the fewest requests are outstanding, so equal work finishes together."""
    clock = VirtualClock()
    perf = PerfModel(TINY, H800, 1)
    engines = [RecordingEngine(perf, clock, lambda req: 10, engine_id=i) for i in range(3)]
    driver = EngineDriver(LocalFleet(engines, clock, SimRewardSink(clock)))
    params = SamplingParams(max_new_tokens=64)
    sizes = [4, 4, 4, 2, 2, 2]  # racing: r0 = n - 1
    groups = [GroupLaunch(k, Prompt(uid=k, input_ids=[1] * 8, data_source="t"), n, n - 1, f"p{k}e0r", f"{k}:", params)
              for k, n in enumerate(sizes)]
    groups.append(GroupLaunch(6, Prompt(uid=6, input_ids=[1] * 8, data_source="t"), 3, 3, "p6e0r", "6:", params))
    assert driver.launch(groups) == len(groups)
    held = [{rid.split("r")[0] for rid in e.submitted} for e in engines]
    assert sorted(len(e.submitted) for e in engines) == [7, 7, 7]  # 21 requests over 3 engines
    assert sum(uid != "p6e0" for h in held for uid in h) == 6, "a racing group was split over engines"
    assert all("p6e0" in h for h in held), "the group that does not race was not spread"
    done = []
    while driver.open_groups:
        for _, news in driver.poll():
            done += news.done
    driver.end()
    assert sorted(d.key for d in done) == list(range(len(groups)))
    assert all(len(d.group) == groups[d.key].r0 and set(d.group.lengths) == {10} for d in done)
    assert sorted(s.response_index for d in done if d.key == 6 for s in d.group.samples) == [0, 1, 2]
    assert driver.bubble_fraction() < 0.2  # balanced engines finish close together
    assert driver.counters() == (0, 10 * 21)
    assert sorted(r for r, _, _ in driver.reports[0].spans[6] + driver.reports[1].spans[6]
                  + driver.reports[2].spans[6]) == [0, 1, 2]  # the trace finds the spread group's requests
    # a limit stops placing at the first group that does not fit
    more = [GroupLaunch(10 + k, g.prompt, g.n, g.r0, f"q{k}r", g.seed_prefix, params) for k, g in enumerate(groups)]
    driver = EngineDriver(LocalFleet(engines, clock, SimRewardSink(clock)))
    assert driver.launch(more, limit=5) == 3 and driver.outstanding == 12


def test_a_real_clock_fleet_with_nothing_generating_sleeps_until_a_score_wakes_it(monkeypatch):
    """Waiting for scores only (no engine generates), the fleet sleeps on its wake-up, not in naps:
    with that sleep's bound and the engines' poll interval set to an hour, only the score's ``wake``
    can end the waits."""
    import threading

    from rollpacker.scheduler import fleet as fleet_module
    from rollpacker.scheduler.clock import RealClock

    monkeypatch.setattr(fleet_module, "_SCORE_WAIT_S", 3600.0)
    fleet = LocalFleet([], RealClock(), None, idle_poll_s=3600.0)
    waits = threading.Thread(target=lambda: (fleet.poll(wait=True), fleet.wait_for_time()), daemon=True)
    waits.start()
    for _ in range(2):  # one wake per wait; a wake before a wait begins is not lost
        fleet.wake()
        waits.join(timeout=0.5)
    waits.join(timeout=60)
    assert not waits.is_alive(), "a wake did not end the fleet's wait"


def test_two_phase_api_guards():
    h = Harness(p0=4, r0=2, engines=2)
    plan = h.scheduler.plan_round()
    with pytest.raises(RuntimeError, match="planned"):
        h.scheduler.state_dict()
    with pytest.raises(RuntimeError, match="planned and not run"):
        h.scheduler.plan_round()
    perf = PerfModel(TINY, H800, 1)
    with pytest.raises(ValueError, match="2 engines; got 1"):
        h.scheduler.run_round(plan, LocalFleet([SimEngine(perf, h.clock, h.oracle)], h.clock, h.sink))


def test_long_round_hands_engines_to_training_and_migrates_their_requests():
    """at 20-50% done, up to half the engines leave; their requests continue elsewhere."""
    h = Harness(p0=8, r0=4, num_prompts=30, engines=4)
    released: list[tuple[list[int], float]] = []
    calls_after: list[str] = []

    def on_release(engines):
        released.append((engines, h.clock.now()))
        for i in engines:  # a released engine's ranks now train: any further call on it is a bug
            e = h.last_engines[i]
            for name in ("submit", "poll", "abort", "evict", "stats"):
                setattr(e, name, lambda *a, name=name, **k: calls_after.append(name))

    policy = HandoffPolicy(candidates=(3, 2, 1), on_release=on_release)
    for _ in range(5):
        plan, result = h.round(handoff=policy)
        assert_batch(result, 8, 4, h.aborted())
    assert plan.kind is RoundKind.LONG and len(released) == 1 and not calls_after
    engines, _ = released[0]
    assert engines == [3, 2]  # half of 4 engines, in the program's order
    s = result.stats
    assert 0.2 <= s.handoff_fraction <= 0.5 and s.migrated_requests > 0 and s.migrated_tokens > 0
    submitted = {rid: r for e in h.last_engines[2:] + h.last_engines[:2] for rid, r in e.submitted.items()}
    resumed = {rid for rid, r in submitted.items() if r.resume_ids}
    assert resumed and len(resumed) <= s.migrated_requests
    for sample in result.samples:  # migrated responses keep their tokens: full modeled length
        assert sample.num_response_tokens == min(h.oracle(submitted[sample.request_id]), h.limit)
    # no short round ever hands off, and the long round's responses all ran (no speculation)
    assert s.launched_responses == 32 and not h.aborted()


@pytest.mark.parametrize("kv_capacity, hands_off", [(600, False), (20000, True)])
def test_handoff_only_when_the_kv_projection_fits(kv_capacity, hands_off):
    h = Harness(p0=8, r0=4, num_prompts=30, engines=2, limit=512, kv_capacity=kv_capacity)
    released = []
    policy = HandoffPolicy(candidates=(1,), on_release=released.append)
    for _ in range(5):
        plan, result = h.round(handoff=policy)
    assert plan.kind is RoundKind.LONG
    assert (released == [[1]]) is hands_off and (result.stats.migrated_requests > 0) is hands_off


def test_handoff_is_checked_at_every_finished_request_even_when_one_poll_returns_many():
    """A busy coordinator gets many completions from one poll. Here the 20 short responses of a long
    round (62% of it) come back together: checked once per poll, the 20-50% window would be stepped
    over and the round would never hand off (a loaded CI machine did exactly that)."""
    clock = VirtualClock()
    prompts = tuple(Prompt(uid=i, input_ids=[1] * 16, data_source="t") for i in range(8))
    plan = RoundPlan(index=0, kind=RoundKind.LONG, tp=1, prompts=prompts, n_responses=4, target_groups=8)
    lengths = lambda r: 64 if parse_request_id(r.request_id)[0] < 5 else 2000  # noqa: E731
    engines = [SimEngine(PerfModel(TINY, H800, 1), clock, lengths, engine_id=i) for i in range(2)]
    sink = SimRewardSink(clock)
    driver, batches, released = EngineDriver(LocalFleet(engines, clock, sink), progress=True), [], []
    poll = driver.poll

    def counted():
        news = poll()
        batches.append(sum(len(n.finished) for _, n in news))
        return news

    driver.poll = counted
    trigger = HandoffTrigger(HandoffPolicy(candidates=(1,), on_release=released.append), 32, 2)
    launches = [GroupLaunch(0, p, 4, 4, f"p{p.uid}e0r", f"0:0:p{p.uid}e0r", SamplingParams(max_new_tokens=4096),
                            reward_key=f"p{p.uid}") for p in prompts]
    result = RoundRunner(plan, driver=driver, launches=launches, async_reward=True, keeps=lambda g: True,
                         replacement=lambda: None, on_group_done=None, handoff=trigger).run()
    print(f"responses generated per poll: {[n for n in batches if n]}; "
          f"handed off at {result.stats.handoff_fraction:.2f}")
    assert max(batches) == 20  # every short response in one poll: 0 -> 62% of the round done
    assert released == [[1]] and 0.2 <= result.stats.handoff_fraction <= 0.5
    # nothing races in a long round: each response went to the engine with the fewest outstanding,
    # alternating, so engine 1 held two of each long prompt's (5 to 7), still generating
    assert result.stats.migrated_requests == 6 and len(result.samples) == 32
    assert sorted(p.uid for p in prompts if any(len(t.placements) == 2 for t in result.trace.requests
                                                 if t.sample.prompt.uid == p.uid)) == [5, 6, 7]
