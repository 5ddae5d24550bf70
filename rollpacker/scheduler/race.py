"""One round, executed: launch, race to ``target_groups`` kept groups, close.

The same runner serves every mode and round kind. A prompt's *group*
completes when ``r0`` of its responses have finished generation and, with
asynchronous reward, scoring; those ``r0`` samples, in the order they
completed, are the group, and the prompt's other requests are aborted at
once. The policy keeps the group or filters it (then a replacement may be
launched). When ``target_groups`` groups are kept the round closes: every
outstanding request is aborted (partial tokens discarded) and each launched
prompt whose group did not complete is deferred, in launch order — including
one whose last responses had finished but were not yet scored. A baseline or
long round launches exactly ``r0`` responses for ``target_groups`` prompts,
so it closes only when every response has finished.

A long round may hand engines to the stream trainer midway (``handoff``, see
handoff.py): their requests are evicted and resubmitted to the engines that
stay with the tokens generated so far, under the same request ids.

With synchronous reward (the "reward after rollout" ablation), a group
completes on generation alone and the kept samples are scored in one stage
after the round closes; ``on_group_done`` then fires after that stage.
"""
from __future__ import annotations

import array
import collections
import functools
import zlib

from dataclasses import dataclass, field
from typing import Callable

from rollpacker.rollout.engine import FINISH_ABORT, FINISH_EVICTED, Completion, GenerationRequest, SamplingParams
from rollpacker.sample import Prompt, Sample
from rollpacker.scheduler.clock import Clock
from rollpacker.scheduler.dispatch import EngineDriver, StalledError
from rollpacker.scheduler.handoff import HandoffTrigger
from rollpacker.scheduler.protocols import RewardSink, ScoreFuture
from rollpacker.scheduler.round import Outcome, RequestTrace, RoundPlan, RoundResult, RoundStats, RoundTrace

GroupCallback = Callable[[list[Sample]], None]


def request_seed(base: int | None, round_index: int, request_id: str) -> int:
    """A request's sampling seed from the run seed, the round and the request id alone.

    Independent of which engine serves it and of what else is in flight, so a
    resumed run samples exactly what the uninterrupted run would have.
    """
    return zlib.crc32(f"{base or 0}:{round_index}:{request_id}".encode())


@dataclass
class _Group:
    prompt: Prompt
    index: int  # launch order within the round
    open: set[str] = field(default_factory=set)  # request ids still outstanding
    ready: list[Sample] = field(default_factory=list)  # generated (and scored, if async), in order
    scoring: dict[str, tuple[Sample, ScoreFuture]] = field(default_factory=dict)
    complete: bool = False
    kept: bool = False


class RoundRunner:
    def __init__(self, plan: RoundPlan, *, r0: int, driver: EngineDriver, reward: RewardSink, clock: Clock,
                 sampling: SamplingParams, async_reward: bool,
                 keeps: Callable[[list[Sample]], bool],
                 replacement: Callable[[], Prompt | None],
                 on_group_done: GroupCallback | None, handoff: HandoffTrigger | None = None) -> None:
        if plan.n_responses < r0:
            raise ValueError(f"plan launches {plan.n_responses} responses per prompt, fewer than r0={r0}")
        self.plan, self.r0, self.driver, self.reward, self.clock = plan, r0, driver, reward, clock
        self.sampling, self.async_reward = sampling, async_reward
        self.keeps, self.replacement, self.on_group_done = keeps, replacement, on_group_done
        self.groups: list[_Group] = []  # launch order
        self.by_request: dict[str, tuple[_Group, Sample]] = {}
        self.kept: list[list[Sample]] = []
        self.filtered: list[Prompt] = []
        self.filtered_tokens: list[int] = []
        self.scoring_groups: set[int] = set()  # indices into self.groups with futures pending
        # a future with add_done_callback (the reward pool's) names its group here once done (from the
        # pool's thread); the others' groups are polled: checking every pending future each loop is
        # quadratic in a round's requests
        self.scored: collections.deque[int] = collections.deque()
        self.polled_groups: set[int] = set()
        self.handoff = handoff
        self.requests: dict[str, GenerationRequest] = {}
        self.finished = [0, 0]  # requests finished generating, their response tokens
        self.migrated = [0, 0]  # requests moved off released engines, the tokens they carried
        self.handed_off: tuple[float, tuple[int, ...]] | None = None  # when, which engines
        self.abandoned: list[str] = []  # open requests of groups completed since the last abort

    def run(self) -> RoundResult:
        start = self.clock.now()
        self._launch(*self.plan.prompts)  # one submit: one message per engine, not per prompt and engine
        while not self._closed():
            if self.driver.outstanding:
                for completion in self.driver.poll():
                    self._on_completion(completion)
                    # at each one: a poll that returns many must not step over the hand-off window
                    self._maybe_hand_off()
            elif self.scoring_groups:
                self.driver.wait_for_time()
            else:
                raise StalledError(f"round {self.plan.index}: {len(self.kept)}/{self.plan.target_groups} groups "
                                   "kept and nothing left running; an engine lost requests")
            self._collect_scores()
            self._abort_abandoned()
        self.driver.abort(self.driver.outstanding_ids())
        rollout_end = self.clock.now()
        bubble = self.driver.bubble_fraction()
        if not self.async_reward:
            self._score_after_rollout()
        return self._result(start, rollout_end, bubble)

    def _launch(self, *prompts: Prompt) -> None:
        now = self.clock.now()
        requests = []
        for prompt in prompts:
            group = _Group(prompt, len(self.groups))
            self.groups.append(group)
            # packed once for all its responses: as a list, each response pickled the prompt token by token
            input_ids = array.array("i", prompt.input_ids)
            for r in range(self.plan.n_responses):
                sample = Sample(prompt=prompt, response_index=r, submitted_at=now)
                rid = sample.request_id
                self.by_request[rid] = (group, sample)
                group.open.add(rid)
                params = self.sampling.with_seed(request_seed(self.sampling.seed, self.plan.index, rid))
                self.requests[rid] = GenerationRequest(rid, input_ids, params)
                requests.append(self.requests[rid])
        self.driver.submit(requests)

    def _maybe_hand_off(self) -> None:
        if self.handoff is None:
            return
        released = self.handoff.decide(*self.finished, running=self.driver.outstanding, stats=self.driver.active_stats)
        if not released:
            return
        handed = self.driver.retire(released)
        self.handed_off = (self.clock.now(), tuple(released))
        partials = [c for c in handed if c.finish_reason == FINISH_EVICTED]
        self.driver.submit(self.requests[c.request_id].resumed_from(c) for c in partials)
        self.migrated = [len(partials), sum(len(c.output_ids) for c in partials)]
        self.handoff.policy.on_release(released)
        for c in handed:
            if c.finish_reason != FINISH_EVICTED:
                self._on_completion(c)

    def _on_completion(self, c: Completion) -> None:
        group, sample = self.by_request[c.request_id]
        group.open.discard(c.request_id)
        if group.complete or c.finish_reason == FINISH_ABORT or self._closed():
            return
        self.finished[0] += 1
        self.finished[1] += len(c.output_ids)
        sample.response_ids = c.output_ids  # not copied: per token, that was rank 0's largest cost
        sample.rollout_logprobs = c.logprobs
        sample.finish_reason = c.finish_reason
        sample.finished_at = self.clock.now()
        if self.async_reward:
            future = self.reward.submit(sample)
            group.scoring[c.request_id] = (sample, future)
            self.scoring_groups.add(group.index)
            if not self._when_scored(future, functools.partial(self._scored, group.index)):
                self.polled_groups.add(group.index)
        else:
            self._ready(group, sample)

    def _when_scored(self, future: ScoreFuture, then: Callable[[], None]) -> bool:
        """``then()`` and a wake of the driver when ``future`` is scored (from the scoring thread), if
        it tells when it is (the reward pool's); False for one that must be asked (the simulator's)."""
        if not callable(getattr(future, "add_done_callback", None)):
            return False

        def done(_: ScoreFuture) -> None:
            then()
            self.driver.wake()

        future.add_done_callback(done)
        return True

    def _scored(self, group_index: int) -> None:
        """A score came: its group is looked at (told, not asked every loop)."""
        self.scored.append(group_index)

    def _collect_scores(self) -> None:
        told = set()
        while self.scored:
            told.add(self.scored.popleft())
        for gi in sorted((told & self.scoring_groups) | self.polled_groups):
            group = self.groups[gi]
            for rid, (sample, future) in list(group.scoring.items()):
                if group.complete or self._closed():
                    break
                if future.done():
                    del group.scoring[rid]
                    _fill_score(sample, future, self.clock.now())
                    self._ready(group, sample)
            if group.complete or not group.scoring:
                self.scoring_groups.discard(gi)
                self.polled_groups.discard(gi)

    def _abort_abandoned(self) -> None:
        """One abort per engine for every group completed in this pass, not one per group: at a
        cluster's scale a message per group and engine was much of rank 0's traffic."""
        if self.abandoned:
            self.driver.abort(self.abandoned)
            self.abandoned = []

    def _closed(self) -> bool:
        """P0 groups are kept: whatever else finishes in the same poll is too late."""
        return len(self.kept) >= self.plan.target_groups

    def _ready(self, group: _Group, sample: Sample) -> None:
        group.ready.append(sample)
        if len(group.ready) < self.r0:
            return
        group.complete = True
        group.scoring.clear()  # late scores of the extras are ignored
        self.abandoned += group.open
        group.open.clear()
        if not self.keeps(group.ready):
            self.filtered.append(group.prompt)
            self.filtered_tokens.append(max(s.num_response_tokens for s in group.ready))
            extra = self.replacement()
            if extra is not None:
                self._launch(extra)
            return
        group.kept = True
        self.kept.append(group.ready)
        if self.async_reward and self.on_group_done is not None:
            self.on_group_done(group.ready)

    def _score_after_rollout(self) -> None:
        pending = [(s, self.reward.submit(s)) for group in self.kept for s in group]
        for _, future in pending:
            self._when_scored(future, lambda: None)
        for sample, future in pending:
            while not future.done():
                self.driver.wait_for_time()
            _fill_score(sample, future, self.clock.now())
        if self.on_group_done is not None:
            for group in self.kept:
                self.on_group_done(group)

    def _result(self, start: float, rollout_end: float, bubble: float) -> RoundResult:
        preemptions, generated = self.driver.counters()
        batch_tokens = sum(s.num_response_tokens for g in self.kept for s in g)
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
        requests = []
        done = {id(s) for g in self.groups if g.complete for s in g.ready}
        for rid, (group, sample) in self.by_request.items():  # launch order
            if not group.complete:
                outcome = Outcome.DEFERRED
            elif id(sample) not in done:
                outcome = Outcome.ABORTED
            else:
                outcome = Outcome.TRAINED if group.kept else Outcome.FILTERED
            placements = tuple((engine, t0 - start, (rollout_end if t1 is None else t1) - start)
                               for engine, t0, t1 in self.driver.placements[rid])
            requests.append(RequestTrace(sample, outcome, placements))
        at, released = self.handed_off or (None, ())
        return RoundTrace(self.driver.engines, requests, rollout_end - start,
                          None if at is None else at - start, released)


def _fill_score(sample: Sample, future: ScoreFuture, now: float) -> None:
    score = future.result()
    sample.reward = float(score.reward)
    sample.correct = score.correct
    sample.reward_reason = score.reason
    sample.scored_at = now
