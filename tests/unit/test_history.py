"""History-aware tail batching: the real scheduler over modeled engines, several epochs.

Response lengths come from a table by (prompt uid, epoch), so a test can make
a prompt long in one epoch and short in the next.
"""
from __future__ import annotations

import io
import random
from collections import Counter

import pytest
import torch

from rollpacker.config import load_config
from rollpacker.configlib import ConfigError
from rollpacker.rollout.config import RolloutConfig
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource, LocalFleet, RoundKind, Scheduler, VirtualClock
from rollpacker.scheduler.config import HistoryConfig, PlannerConfig, SchedulerConfig
from rollpacker.scheduler.history import BYTES_PER_PROMPT, Outcome, PromptHistory
from rollpacker.sim import H800, ModelSpec, PerfModel, SimEngine, SimRewardSink

TINY = ModelSpec("tiny", 5e8, 8, 1024, 2)
LIMIT = 4096


def request_key(request_id: str) -> tuple[int, int, int]:
    head, _, index = request_id.rpartition("r")
    uid, _, epoch = head[1:].partition("e")
    return int(uid), int(epoch), int(index)


class Run:
    """One scheduler over ``num_prompts`` prompts; ``length(uid, epoch, index, attempt)`` in tokens."""

    def __init__(self, length, *, history: bool, mode="tail_batching", p0=8, r0=4, num_prompts=32, engines=2,
                 reward_fn=None, **history_knobs):
        self.clock = VirtualClock()
        self.length = length
        self.attempts: Counter = Counter()
        self.cfg = SchedulerConfig(mode=mode, p0=p0, r0=r0, planner=PlannerConfig(enabled=False),
                                   history=HistoryConfig(enabled=history, **history_knobs))
        self.prompts = [Prompt(uid=i, input_ids=[1] * 16, data_source="t") for i in range(num_prompts)]
        self.engines = engines
        self.sink = SimRewardSink(self.clock, reward_fn or (lambda s: 1.0), lambda s: 0.001)
        self.scheduler = self.new_scheduler()
        self.rounds = []
        self.done: Counter = Counter()  # (uid, epoch) -> times trained or filtered

    def new_scheduler(self) -> Scheduler:
        self.source = ListPromptSource(self.prompts)
        return Scheduler(self.cfg, RolloutConfig(max_response_length=LIMIT), self.source, rollout_ranks=self.engines)

    def oracle(self, request) -> int:
        key = request_key(request.request_id)
        attempt = self.attempts[key, request.params.seed]
        self.attempts[key, request.params.seed] += 1
        return max(1, min(LIMIT, self.length(*key, attempt)))

    def round(self):
        plan = self.scheduler.plan_round()
        perf = PerfModel(TINY, H800, plan.tp)
        engines = [SimEngine(perf, self.clock, self.oracle, engine_id=i) for i in range(self.engines // plan.tp)]
        result = self.scheduler.run_round(plan, LocalFleet(engines, self.clock, self.sink))
        self.rounds.append((plan, result))
        return plan, result

    def until_trained(self, epochs: int, max_rounds: int = 400) -> Counter:
        """Rounds until every prompt of epochs 0..epochs-1 is trained or filtered; returns ``done``."""
        need = {(p.uid, e) for p in self.prompts for e in range(epochs)}
        for _ in range(max_rounds):
            if need <= set(self.done):
                return self.done
            _, result = self.round()
            self.done.update((g[0].prompt.uid, g[0].prompt.epoch) for g in result.groups)
            self.done.update((p.uid, p.epoch) for p in result.filtered)
        raise AssertionError(f"{len(need - set(self.done))} prompts of epochs < {epochs} never trained")

    def waste(self, rounds=None) -> float:
        rounds = self.rounds if rounds is None else rounds
        return sum(r.stats.wasted_tokens for _, r in rounds) / sum(r.stats.generated_tokens for _, r in rounds)


def bimodal(uid, epoch, index, attempt):
    """A quarter of the prompts are long every epoch; responses vary a little."""
    rng = random.Random(f"{uid}/{epoch}/{index}/{attempt}")
    return int((2400 if uid % 4 == 0 else 200) * rng.uniform(0.7, 1.3))


def test_history_reorders_prompts_and_removes_the_failed_attempts():
    runs = {on: Run(bimodal, history=on, margin=1.0) for on in (False, True)}
    trained = {on: run.until_trained(3) for on, run in runs.items()}
    for on, done in trained.items():  # the ledger: each prompt of each epoch trained once, with history or not
        complete = {k: n for k, n in done.items() if k[1] < 3}
        assert complete == {(p.uid, e): 1 for p in runs[on].prompts for e in range(3)}
    hist = runs[True]
    admission = hist.scheduler.policy.admission
    # from the second epoch on, the long prompts skip the race (but for the probes): only long rounds launch them
    late = [(plan, result) for plan, result in hist.rounds if min(p.epoch for p in plan.prompts) >= 1]
    assert late
    raced_long = [p for plan, _ in late if plan.kind is RoundKind.SHORT for p in plan.prompts if p.uid % 4 == 0]
    assert all(admission._is_probe(p) for p in raced_long), raced_long
    assert all(len(plan.prompts) <= 10 for plan, _ in late)  # routed prompts fill the over-launch budget
    assert hist.scheduler.counters["routed"] >= 8 - len(raced_long)  # the long prompts of epoch 1
    assert hist.scheduler.history.routing and hist.scheduler.history.precision > 0.9  # probes lost their races
    assert runs[False].scheduler.counters["routed"] == 0
    # history changes the order, not what is generated per trained response: less waste, same prompts
    assert hist.waste(late) < 0.5 * runs[False].waste()
    assert sum(r.stats.rollout_seconds for _, r in hist.rounds) < sum(
        r.stats.rollout_seconds for _, r in runs[False].rounds)


def test_routing_pauses_where_lengths_do_not_carry_over():
    """Long or short at random each epoch: probes lose no more than other racers, so routing stops."""

    def coin(uid, epoch, index, attempt):
        rng = random.Random(f"{uid}/{epoch}/{index}/{attempt}")
        return int((2400 if random.Random(f"{uid}/{epoch}").random() < 0.25 else 200) * rng.uniform(0.7, 1.3))

    runs = {on: Run(coin, history=on, probe_fraction=0.1) for on in (False, True)}
    for run in runs.values():
        run.until_trained(6)
    history = runs[True].scheduler.history
    assert not history.routing and history.precision < 0.5
    seconds = {on: sum(r.stats.rollout_seconds for _, r in run.rounds) for on, run in runs.items()}
    assert seconds[True] < 1.05 * seconds[False]


def test_a_prompt_that_became_short_is_trained_in_its_epoch():
    """Long in epoch 0, short afterwards: routed once to a long round, then back in the race."""

    def changing(uid, epoch, index, attempt):
        return 3000 if uid < 8 and epoch == 0 else 200

    run = Run(changing, history=True, probe_fraction=0.0)
    trained = run.until_trained(3)
    assert all(trained[p.uid, e] == 1 for p in run.prompts for e in range(3))
    long_epoch1 = {p.uid for plan, _ in run.rounds if plan.kind is RoundKind.LONG for p in plan.prompts if p.epoch == 1}
    short_epoch1 = {p.uid for plan, _ in run.rounds if plan.kind is RoundKind.SHORT
                    for p in plan.prompts if p.epoch == 1}
    assert set(range(8)) <= long_epoch1 and not set(range(8)) & short_epoch1  # routed on the epoch-0 evidence ...
    short_epoch2 = {p.uid for plan, _ in run.rounds if plan.kind is RoundKind.SHORT
                    for p in plan.prompts if p.epoch == 2}
    assert set(range(8)) <= short_epoch2  # ... then raced again: their long round showed them short


def test_no_prompt_waits_more_than_the_queue_ahead_of_it():
    """Half the prompts predicted long, more than a round's worth: routing stops at a full queue and the long
    round runs. A routed prompt is trained within two rounds of being drawn; any queued prompt within P0 + 1
    (every short round sends its whole over-launch budget, at least one prompt, to the queue: routed or
    deferred; so the queue fills within P0 rounds)."""
    run = Run(lambda uid, epoch, index, attempt: 3000 if uid < 6 and epoch == 0 else 100, history=True, p0=4,
              num_prompts=12, margin=1.0, probe_fraction=0.0)
    drawn_at: dict = {}
    take = run.source.take
    run.source.take = lambda n: [drawn_at.setdefault((p.uid, p.epoch), len(run.rounds)) and p or p for p in take(n)]
    run.until_trained(4)
    trained_at = {(g[0].prompt.uid, g[0].prompt.epoch): i for i, (_, r) in enumerate(run.rounds) for g in r.groups}
    assert run.scheduler.counters["routed"] >= 6
    assert run.scheduler.counters["routed"] > 4  # more than P0 routed: the queue filled while picking
    raced = {(p.uid, p.epoch) for plan, _ in run.rounds if plan.kind is RoundKind.SHORT for p in plan.prompts}
    routed = set(trained_at) - raced
    assert len(routed) >= 6
    assert max(trained_at[k] - drawn_at[k] for k in routed) <= 2
    assert max(trained_at[k] - drawn_at[k] for k in trained_at) <= 4 + 1


def test_state_dict_round_trip_resumes_exactly():
    def lengths(uid, epoch, index, attempt):
        return bimodal(uid, epoch, index, attempt)

    reference = Run(lengths, history=True)
    for _ in range(14):
        reference.round()
    resumed = Run(lengths, history=True)
    for _ in range(9):
        resumed.round()
    buf = io.BytesIO()
    torch.save({"sched": resumed.scheduler.state_dict(), "src": resumed.source.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["sched"]["history"]["closings"]
    resumed.scheduler = resumed.new_scheduler()
    resumed.scheduler.load_state_dict(saved["sched"])
    resumed.source.load_state_dict(saved["src"])
    for _ in range(5):
        resumed.round()
    for (pa, ra), (pb, rb) in zip(reference.rounds[9:], resumed.rounds[9:]):
        assert (pa.kind, pa.prompts, pa.n_responses) == (pb.kind, pb.prompts, pb.n_responses)
        assert [[s.request_id for s in g] for g in ra.groups] == [[s.request_id for s in g] for g in rb.groups]
    assert resumed.scheduler.counters == reference.scheduler.counters
    a, b = reference.scheduler.history.state_dict(), resumed.scheduler.history.state_dict()
    assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_ledger_with_history_and_dynamic_sampling_across_epochs():
    rng = random.Random(5)
    accuracy = {i: rng.choice([0.0, 1.0, 0.5]) for i in range(24)}

    def reward(sample):
        return float(random.Random(sample.request_id).random() < accuracy[sample.prompt.uid])

    run = Run(bimodal, history=True, mode="dynamic_sampling", p0=6, r0=3, num_prompts=24, reward_fn=reward)
    taken = []
    for _ in range(30):
        plan, _ = run.round()
        taken += [(p.uid, p.epoch) for p in plan.prompts]
    trained = [(g[0].prompt.uid, g[0].prompt.epoch) for _, r in run.rounds for g in r.groups]
    filtered = [(p.uid, p.epoch) for _, r in run.rounds for p in r.filtered]
    queued = [(p.uid, p.epoch) for p in run.scheduler.queue.peek()]
    staged = [(p.uid, p.epoch) for p in run.scheduler.policy.admission._staged]
    served = run.source.state_dict()["cursor"]
    assert served == len(set(trained + filtered + queued + staged))  # nothing lost, nothing twice
    assert Counter(trained + filtered + queued + staged).most_common(1)[0][1] == 1
    assert max(e for _, e in trained) >= 2 and filtered and run.scheduler.counters["routed"] > 0


def test_history_is_compact_and_refuses_bad_configs(tmp_path):
    history = PromptHistory(HistoryConfig(enabled=True))
    history._record(Prompt(uid=999_999, input_ids=[1], data_source="t"), Outcome.LONG, 5000, 0.0)
    assert BYTES_PER_PROMPT == 13 and history.nbytes == 13_000_000  # a million prompts: 13 MB
    assert len(history) == 1 and history.predicts_long(999_999) is False  # no short round closed yet
    history._closings = [900, 1000, 5000]
    assert history.predicts_long(999_999) and not history.predicts_long(5)
    for bad, match in [({"history": HistoryConfig(eta_p_seen=0.9)}, "eta_p_seen"),
                       ({"history": HistoryConfig(margin=0)}, "margin")]:
        with pytest.raises(ConfigError, match=match):
            SchedulerConfig(**bad).validate()
    cfg = load_config("configs/tiny-cpu.yaml", ["scheduler.history.margin=1.2"])
    assert cfg.scheduler.history == HistoryConfig(enabled=True, margin=1.2, eta_r_seen=1.0)  # on in the CPU example
    for path in ("configs/qwen2.5-7b.yaml", "configs/qwen2.5-14b.yaml", "configs/qwen2.5-32b.yaml"):
        assert not load_config(path).scheduler.history.enabled  # slower on the modeled GPU cluster
    # the baseline has no race to skip: history is inert there, so switching modes needs no second flag
    assert Run(lambda *_: 8, history=True, mode="baseline").scheduler.history is None
    with pytest.raises(ConfigError, match="eta_r_seen"):
        load_config("configs/tiny-cpu.yaml", ["scheduler.history.eta_r_seen=0.5"])
