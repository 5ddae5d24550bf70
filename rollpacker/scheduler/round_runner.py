"""One round, executed: launch, race to ``target_groups`` kept groups, close.

The same runner serves every mode and round kind. Each launched prompt's *group* goes whole to
one engine, whose race (group_race.py) completes it when ``r0`` of its responses have finished
generation and, with asynchronous reward, scoring; those ``r0`` samples, in the order they
completed, are the group, and its other requests are aborted on the spot. (Where no response
races, r0 of r0, the driver spreads a group's responses over engines and joins them.) Here the policy keeps
the group or filters it (then a replacement may be launched). When ``target_groups`` groups are
kept the round closes: every engine aborts what it still runs (partial tokens discarded) and
each launched prompt whose group had not been reported complete is deferred, in launch order —
including one whose last responses had finished but were not yet scored, or whose completion was
still on its way. A baseline or long round launches exactly ``r0`` responses for
``target_groups`` prompts, so it closes only when every response has finished.

A long round may hand engines to the stream trainer midway (``handoff``, see handoff.py), checked
at each response generated: what they still race is taken back with what it has and launched on
the engines that stay, the partial responses continuing from their tokens under the same request ids.

With synchronous reward (the "reward after rollout" ablation), a group completes on generation
alone and the kept samples are scored in one stage after the round closes; ``on_group_done``
then fires after that stage.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from rollpacker.rollout.engine import SamplingParams
from rollpacker.sample import Prompt, Sample, SampleGroup
from rollpacker.scheduler.dispatch import EngineDriver
from rollpacker.scheduler.fleet import StalledError
from rollpacker.scheduler.group_race import GroupDone, GroupLaunch, RaceNews, RaceReport
from rollpacker.scheduler.handoff import HandoffTrigger
from rollpacker.scheduler.round import Outcome, RequestTrace, RoundPlan, RoundResult, RoundStats, RoundTrace

GroupCallback = Callable[[SampleGroup], None]


@dataclass
class _Group:
    prompt: Prompt
    launched_at: float
    done: SampleGroup | None = None  # reported complete: its r0, in the order they became ready
    complete: bool = False
    kept: bool = False


class RoundRunner:
    def __init__(self, plan: RoundPlan, *, r0: int, driver: EngineDriver, sampling: SamplingParams, async_reward: bool,
                 keeps: Callable[[SampleGroup], bool],
                 replacement: Callable[[], Prompt | None],
                 on_group_done: GroupCallback | None, handoff: HandoffTrigger | None = None) -> None:
        if plan.n_responses < r0:
            raise ValueError(f"plan launches {plan.n_responses} responses per prompt, fewer than r0={r0}")
        self.plan, self.r0, self.driver = plan, r0, driver
        self.reward, self.clock = driver.fleet.reward, driver.fleet.clock
        self.sampling, self.async_reward = sampling, async_reward
        self.keeps, self.replacement, self.on_group_done = keeps, replacement, on_group_done
        self.groups: list[_Group] = []  # launch order; a group's key is its index here
        self.kept: list[SampleGroup] = []
        self.filtered: list[Prompt] = []
        self.filtered_tokens: list[int] = []
        self.handoff = handoff
        self.finished = [0, 0]  # responses generated, their tokens
        self.migrated = [0, 0]  # requests moved off released engines, the tokens they carried
        self.handed_off: tuple[float, tuple[int, ...]] | None = None  # when, which engines

    def run(self) -> RoundResult:
        start = self.clock.now()
        self._launch(*self.plan.prompts)  # one call per engine, not per prompt and engine
        while not self._closed():
            if not self.driver.open_groups:
                raise StalledError(f"round {self.plan.index}: {len(self.kept)}/{self.plan.target_groups} groups "
                                   "kept and nothing left running")
            for _, news in self.driver.poll():
                self._hear(news)
        self.driver.end()
        rollout_end = self.clock.now()
        bubble = self.driver.bubble_fraction()
        if not self.async_reward:
            self._score_after_rollout()
        return self._result(start, rollout_end, bubble)

    def _launch(self, *prompts: Prompt) -> None:
        now, launches = self.clock.now(), []
        for prompt in prompts:
            key = len(self.groups)
            self.groups.append(_Group(prompt, now))
            prefix = f"p{prompt.uid}e{prompt.epoch}r"  # ``Sample.request_id``
            # seeds from the run's seed, the round and the request id (``GroupLaunch.seed``)
            launches.append(GroupLaunch(key, prompt, self.plan.n_responses, self.r0, prefix,
                                        f"{self.sampling.seed or 0}:{self.plan.index}:{prefix}", self.sampling,
                                        scored=self.async_reward, reward_key=f"p{prompt.uid}"))
        self.driver.launch(launches)

    def _hear(self, news: RaceNews) -> None:
        for done in news.done:
            if self._closed():  # whatever else completed in the same poll is too late
                return
            self._group_done(done)
        if self.handoff is not None and not self._closed():
            for tokens in news.finished:  # at each one: news of many must not step over the hand-off window
                self.finished[0] += 1
                self.finished[1] += tokens
                self._maybe_hand_off()

    def _maybe_hand_off(self) -> None:
        released = self.handoff.decide(*self.finished, running=self.driver.outstanding, stats=self.driver.stats)
        if not released:
            return
        self.migrated = list(self.driver.retire(released))
        self.handed_off = (self.clock.now(), tuple(released))
        self.handoff.policy.on_release(released)

    def _group_done(self, done: GroupDone) -> None:
        group = self.groups[done.key]
        if group.complete:  # reported twice (a push that crossed a hand-off)
            return
        group.complete = True
        done.group.prompt = group.prompt  # a remote engine's group comes without it
        group.done = done.group
        if not self.keeps(done.group):
            self.filtered.append(group.prompt)
            self.filtered_tokens.append(max(done.group.lengths))
            extra = self.replacement()
            if extra is not None:
                self._launch(extra)
            return
        group.kept = True
        self.kept.append(done.group)
        if self.async_reward and self.on_group_done is not None:
            self.on_group_done(done.group)

    def _closed(self) -> bool:
        """P0 groups are kept: whatever else completes is too late."""
        return len(self.kept) >= self.plan.target_groups

    def _score_after_rollout(self) -> None:
        pending = [(s, self.reward.submit(s, key=f"p{s.prompt.uid}")) for group in self.kept for s in group.samples]
        for _, future in pending:
            if callable(getattr(future, "add_done_callback", None)):
                future.add_done_callback(lambda _: self.driver.wake())
        for sample, future in pending:
            while not future.done():
                self.driver.wait_for_time()
            score = future.result()
            sample.reward, sample.correct, sample.reward_reason = float(score.reward), score.correct, score.reason
            sample.scored_at = self.clock.now()
        if self.on_group_done is not None:
            for group in self.kept:
                self.on_group_done(group)

    def _result(self, start: float, rollout_end: float, bubble: float) -> RoundResult:
        preemptions, generated = self.driver.counters()
        batch_tokens = sum(sum(g.lengths) for g in self.kept)
        deferred = [g.prompt for g in self.groups if not g.complete]
        stats = RoundStats(
            rollout_seconds=rollout_end - start,
            reward_seconds=self.clock.now() - rollout_end,
            bubble_fraction=bubble,
            generated_tokens=generated,
            batch_tokens=batch_tokens,
            wasted_tokens=max(0, generated - batch_tokens),
            preemptions=preemptions,
            launched_prompts=len(self.groups),
            launched_responses=len(self.groups) * self.plan.n_responses,
            kept_prompts=len(self.kept),
            filtered_prompts=len(self.filtered),
            deferred_prompts=len(deferred),
            migrated_requests=self.migrated[0],
            migrated_tokens=self.migrated[1],
            handoff_fraction=self.handoff.fired_at if self.handoff and self.handoff.fired_at is not None else 0.0,
        )
        return RoundResult(self.plan.index, self.plan.kind, self.plan.tp, self.kept, self.filtered,
                           self.filtered_tokens, deferred, stats, self._trace(start, rollout_end))

    def _trace(self, start: float, rollout_end: float) -> RoundTrace:
        at, released = self.handed_off or (None, ())
        first = sorted(self.driver.reports, key=lambda i: self.driver.retired_at(i) is None)  # held it first
        build = functools.partial(_request_traces, self.groups, [(i, self.driver.reports[i]) for i in first],
                                  self.plan.n_responses, start)
        return RoundTrace(self.driver.engines, build, rollout_end - start, None if at is None else at - start,
                          released)


def _request_traces(groups: list[_Group], reports: list[tuple[int, RaceReport]], n: int,
                    start: float) -> list[RequestTrace]:
    """Every launched request, in launch order, with the engines that held it (from the races' reports,
    in the order they held it) and what became of it."""
    spans: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
    for engine, report in reports:
        for key, held in report.spans.items():
            for r, t0, t1 in held:
                spans.setdefault((key, r), []).append((engine, t0 - start, t1 - start))
    requests = []
    for key, group in enumerate(groups):
        done = {s.response_index: s for s in group.done.samples} if group.done is not None else {}
        for r in range(n):
            sample = done.get(r) or Sample(prompt=group.prompt, response_index=r, submitted_at=group.launched_at)
            if not group.complete:
                outcome = Outcome.DEFERRED
            elif r not in done:
                outcome = Outcome.ABORTED
            else:
                outcome = Outcome.TRAINED if group.kept else Outcome.FILTERED
            requests.append(RequestTrace(sample, outcome, tuple(spans.get((key, r), ()))))
    return requests
