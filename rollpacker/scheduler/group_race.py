"""One engine's share of a round: the prompt groups placed on it, raced where the engine is.

A round places each launched prompt, all of its responses, on one engine. The engine's race
submits the responses, hands each finished one to the reward sink, and completes the group on
its first ``r0`` ready responses (generated and, with asynchronous reward, scored): it aborts the
group's other responses on the spot and reports the group. So the coordinator hears about a
group once, not about each response several times (its completion, its score, its extras'
aborts), and its cost follows the prompts of a round rather than their responses
(``bench/system/control.py``).

The race runs in rank 0's process for rank 0's own engine (and for every engine of a modeled
cluster, on a virtual clock), and inside the ``EngineServer`` of an engine that another rank
leads, with that node's reward pool; the coordinator drives both alike (``EngineDriver`` through a
``Fleet``).

The deterministic race (``scheduler.race``; ``GroupLaunch.logical``) decides by lengths instead:
a response's finishing time is its length in tokens (its reward counted as instantaneous), so a
group's ``r0`` are its ``r0`` shortest responses (ties: the lower response index) and its *mark*
is the ``r0``-th of those lengths, ties between groups broken by a key fixed by the run's seed
(``GroupLaunch.tie``). A group completes once that set is certain: every response still running
has generated at least as many tokens as the mark (``RolloutEngine.progress``), and its ``r0``
are scored. The race also tells the *floor*: the least mark any of its open groups could still
get, from what each response has generated so far. The coordinator closes the round on the
``P0`` least marks once no engine's floor is below them (round_runner.py), so which prompts a
round trains depends on the sampled lengths alone, not on the machine's timing.

A race lives one round: ``end`` aborts what is left and reports where each request of the
groups not yet reported ran and what the engine did; ``retire`` (the stream trainer's hand-off)
evicts its groups instead and hands back their state, so that another engine's race carries
on with the responses already generated and scored.
"""
from __future__ import annotations

import array
import collections
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

from rollpacker.rollout.engine import (FINISH_EVICTED, Completion, EngineStats, GenerationRequest, RolloutEngine,
                                       SamplingParams)
from rollpacker.sample import Prompt, Sample, SampleGroup
from rollpacker.scheduler.clock import Clock
from rollpacker.scheduler.protocols import RewardSink, ScoreFuture

Span = tuple[int, float, float]  # (response index, submitted, released) on one engine, on the race's clock


@dataclass
class GroupLaunch:
    """One prompt's group, or a part of it, as the coordinator hands it to an engine's race."""

    key: int  # the group's index in its round, launch order (a part's: the driver's own)
    prompt: Prompt
    n: int  # responses launched for the prompt
    r0: int  # ready responses that complete the group (a part: all its responses)
    request_prefix: str  # response r's request id is the prefix and r
    # response r samples with seed crc32(seed_prefix + r): fixed by the run and the response alone,
    # whichever engine runs it and whatever else it runs, so a resumed run samples what the first did
    seed_prefix: str
    params: SamplingParams  # every response's, but for its seed
    scored: bool = True  # a response is ready once scored (False: once generated)
    reward_key: str | None = None  # the code timeouts' prompt key (None: from the tests' content)
    adapt: bool = True  # its scores adapt the code timeouts (an eval's do not)
    responses: tuple[int, ...] = ()  # a part's response indices (empty: all n)
    logical: bool = False  # the deterministic race: complete on the r0 shortest responses, by length
    # carried over from an engine handed to the stream trainer: the ready responses in the order
    # they became ready, the finished ones not yet scored, and where the others had got to
    ready: list[Sample] = field(default_factory=list)
    unscored: list[Sample] = field(default_factory=list)
    partial: dict[int, Completion] = field(default_factory=dict)

    @property
    def indices(self) -> Sequence[int]:
        return self.responses or range(self.n)

    def request_id(self, r: int) -> str:
        return f"{self.request_prefix}{r}"

    def seed(self, r: int) -> int:
        return zlib.crc32(f"{self.seed_prefix}{r}".encode())

    @property
    def tie(self) -> int:
        """Orders groups of equal marks: fixed by the run's seed, the round and the prompt."""
        return zlib.crc32(self.seed_prefix.encode())

    def migrated(self) -> tuple[int, int]:
        """(requests carried over mid-generation, the tokens they had generated)."""
        return len(self.partial), sum(len(c.output_ids) for c in self.partial.values())


Mark = tuple[int, int]  # (the r0-th shortest response length, the group's tie key): the deterministic race's order


@dataclass
class GroupDone:
    key: int
    group: SampleGroup  # the first r0 ready responses, in the order they became ready (logical: by index)
    mark: Mark | None = None  # the deterministic race's (None: the group was not raced by length)

    def __reduce__(self):
        # to the coordinator, which launched the prompt: the group crosses without it (it puts its own back)
        return GroupDone, (self.key, self.group.stripped(), self.mark)


@dataclass
class RaceNews:
    """What one engine's race has to tell since it last told."""

    done: list[GroupDone] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # the token counts of responses generated since
    open: int = 0  # requests outstanding on the engine now
    # the deterministic race: the least mark its open groups could still get (None: none open), as
    # of the ``launched``-th part it was given; ``moved``: either changed since the race last told
    floor: Mark | None = None
    launched: int = 0
    moved: bool = False

    def __bool__(self) -> bool:
        return bool(self.done or self.finished or self.moved)


@dataclass
class RaceReport:
    """What a race tells when it ends or retires: where the requests of its groups ran (all of
    them, complete or not: a group's news may not have reached the coordinator when the round
    closed), and the engine's share of the round's accounting."""

    spans: dict[int, list[Span]] = field(default_factory=dict)  # by group key
    busy_seconds: float = 0.0  # request-seconds outstanding on the engine (its slots' busy time)
    peak: int = 0  # most requests outstanding at once (its slots)
    preemptions: int = 0
    generated_tokens: int = 0
    undelivered: list[RaceNews] = field(default_factory=list)  # news a remote race's server could not push yet


@dataclass
class _Group:
    launch: GroupLaunch
    samples: dict[int, Sample]  # by response index
    ready: list[Sample]
    open: set[int] = field(default_factory=set)  # response indices outstanding on the engine
    scoring: dict[int, ScoreFuture] = field(default_factory=dict)  # by response index
    spans: list[Span] = field(default_factory=list)


class GroupRace:
    """The groups placed on ``engine`` this round. ``wake`` is called (from the reward pool's
    thread) when a score comes, so that whoever waits on this race looks again."""

    def __init__(self, engine: RolloutEngine, reward: RewardSink | None, clock: Clock, *,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.engine, self.reward, self.clock, self._wake = engine, reward, clock, wake
        self._groups: dict[int, _Group] = {}  # not yet complete, by key
        self._spans: dict[int, list[Span]] = {}  # every group's requests on this engine this round, by key
        self._requests: dict[str, tuple[_Group, int, float]] = {}  # outstanding: (group, response, submitted)
        self._scores_for: collections.deque[int] = collections.deque()  # keys a score callback named
        self._abandoned: list[str] = []  # requests of groups completed in this step, aborted at its end
        self._news = RaceNews()
        self._counts0: tuple[int, int] | None = None  # the engine's counters at the round's first launch
        self._busy, self._peak, self._last = 0.0, 0, clock.now()
        self._launched = 0
        self._logical = False  # a group of the deterministic race was launched: floors are news
        self._told: tuple[Mark | None, int] = (None, 0)  # (floor, launched) as last told

    # --- the coordinator's calls -------------------------------------------------------------------
    def launch(self, groups: Sequence[GroupLaunch]) -> None:
        """Submit every response of ``groups`` (one call to the engine); a migrated group's ready and
        unscored responses are not generated again, its partial ones continue from their tokens. A
        launch the engine refuses (``RequestError``) leaves the race as it was."""
        if self._counts0 is None:
            stats = self.engine.stats()  # copied: an engine may hand out one object it keeps updating
            self._counts0 = (stats.preemptions, stats.tokens_generated)
        now, requests, placed = self.clock.now(), [], []
        for g in groups:
            if g.key in self._groups:
                raise ValueError(f"group {g.key} is already racing on engine {self.engine.engine_id}")
            group = _Group(g, {r: Sample(prompt=g.prompt, response_index=r, submitted_at=now) for r in g.indices},
                           list(g.ready))
            carried = {s.response_index for s in (*g.ready, *g.unscored)}
            for s in (*g.ready, *g.unscored):
                group.samples[s.response_index] = s
            input_ids = array.array("i", g.prompt.input_ids)  # once for all its responses: cheap to ship
            for r in g.indices:
                if r not in carried:
                    request = GenerationRequest(g.request_id(r), input_ids, g.params.with_seed(g.seed(r)),
                                                report_progress=g.logical)
                    requests.append((group, r, request.resumed_from(g.partial[r]) if r in g.partial else request))
            placed.append(group)
        self.engine.submit([request for _, _, request in requests])
        self._account()
        self._launched += len(placed)
        self._logical = self._logical or any(g.logical for g in groups)
        for group in placed:
            self._groups[group.launch.key] = group
            self._spans[group.launch.key] = group.spans
        for group, r, request in requests:
            group.open.add(r)
            self._requests[request.request_id] = (group, r, now)
        for group in placed:
            for s in group.launch.unscored:
                self._score(group, s)
        self._peak = max(self._peak, len(self._requests))

    def step(self, timeout: float | None = 0.0) -> RaceNews:
        """Advance the engine (waiting up to ``timeout`` for a completion when it has work), take
        the scores that came, complete the groups that are; what happened since the last step."""
        completions = self.engine.poll(timeout) if self._requests else []
        if completions:
            self._account()
            for c in completions:
                self._finished(c)
        self._collect_scores()
        floor = self._settle()
        if self._abandoned:
            self._account()
            self.engine.abort(self._abandoned)
            self._abandoned = []
        news, self._news = self._news, RaceNews()
        news.open = len(self._requests)
        news.floor, news.launched = floor, self._launched
        news.moved = self._logical and (floor, self._launched) != self._told
        self._told = (floor, self._launched)
        return news

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def generating(self) -> bool:
        """Requests are outstanding on the engine (stepping it makes progress)."""
        return bool(self._requests)

    def end(self) -> RaceReport:
        """The round is over: abort every request left; the report."""
        self._account()
        if self._requests:
            self.engine.abort(list(self._requests))
        now = self.clock.now()
        for rid, (group, r, start) in self._requests.items():
            group.spans.append((r, start, now))
        self._requests.clear()
        return self._report()

    def retire(self) -> tuple[list[GroupLaunch], RaceReport]:
        """The engine leaves the round: every open group is handed back with what it has (ready
        responses, finished ones whose scores had not come, partial ones with their tokens)."""
        self._account()
        handed = self.engine.evict(list(self._requests)) if self._requests else []
        now = self.clock.now()
        for c in handed:
            group, r, start = self._requests.pop(c.request_id)
            group.open.discard(r)
            group.spans.append((r, start, now))
            if c.finish_reason == FINISH_EVICTED:
                group.launch.partial[r] = c
            else:
                group.scoring[r] = None  # finished here: scored on the engine that takes the group
                self._fill(group.samples[r], c, now)
        for rid, (group, r, start) in self._requests.items():  # none left by a correct engine
            group.spans.append((r, start, now))
        self._requests.clear()
        states = []
        for group in self._groups.values():
            g = group.launch
            g.ready = list(group.ready)
            g.unscored = [group.samples[r] for r in sorted(group.scoring)]
            g.partial = {r: c for r, c in g.partial.items() if r not in group.scoring and
                         all(s.response_index != r for s in g.ready)}
            states.append(g)
        return states, self._report()

    # --- a response's way through --------------------------------------------------------------------
    def _finished(self, c: Completion) -> None:
        entry = self._requests.pop(c.request_id, None)
        if entry is None:  # one its own abort crossed
            return
        group, r, start = entry
        group.open.discard(r)
        now = self.clock.now()
        group.spans.append((r, start, now))
        sample = group.samples[r]
        self._fill(sample, c, now)
        self._news.finished.append(len(c.output_ids))
        if group.launch.scored:
            self._score(group, sample)
        else:
            self._ready(group, sample)

    @staticmethod
    def _fill(sample: Sample, c: Completion, now: float) -> None:
        sample.response_ids = c.output_ids  # not copied: per token, that was the coordinator's largest cost
        sample.rollout_logprobs = c.logprobs
        sample.routed_experts = c.routed_experts
        sample.finish_reason = c.finish_reason
        sample.finished_at = now

    def _score(self, group: _Group, sample: Sample) -> None:
        g = group.launch
        future = self.reward.submit(sample, key=g.reward_key, adapt=g.adapt)
        group.scoring[sample.response_index] = future
        future.add_done_callback(lambda _, key=g.key: self._scored(key))

    def _scored(self, key: int) -> None:
        """From the scoring thread: a score of group ``key`` came."""
        self._scores_for.append(key)
        self._wake()

    def _collect_scores(self) -> None:
        told = set()
        while self._scores_for:
            told.add(self._scores_for.popleft())
        for key in sorted(told & self._groups.keys()):
            group = self._groups[key]
            for r, future in list(group.scoring.items()):
                if future.done():
                    del group.scoring[r]
                    score = future.result()
                    sample = group.samples[r]
                    sample.reward, sample.correct, sample.reward_reason = float(score.reward), score.correct, score.reason
                    sample.scored_at = self.clock.now()
                    self._ready(group, sample)
                    if key not in self._groups:  # complete: its other scores do not count
                        break

    def _ready(self, group: _Group, sample: Sample) -> None:
        group.ready.append(sample)
        if group.launch.logical or len(group.ready) < group.launch.r0:
            return  # a logical group waits for _settle: the first ready need not be the shortest
        self._complete(group, group.ready)

    def _settle(self) -> Mark | None:
        """The deterministic race: complete each group whose r0 shortest responses are certain and
        scored; returns the least mark an open group could still get (None: none is open)."""
        if not self._logical:  # the wall-clock race: nothing to settle on its engines' hot loop
            return None
        groups = [g for g in self._groups.values() if g.launch.logical]
        running = [g.launch.request_id(r) for g in groups for r in g.open]
        made = dict(zip(running, self.engine.progress(running))) if running else {}
        floor = None
        for group in groups:
            g = group.launch
            # (length, index): a finished response's; a running one's least final length is one
            # token more than it has
            finished = sorted((len(group.samples[r].response_ids), r) for r in g.indices if r not in group.open)
            least = sorted((made[g.request_id(r)] + 1, r) for r in group.open)
            if len(finished) >= g.r0:
                best, ready = finished[:g.r0], {s.response_index for s in group.ready}
                if (not least or least[0] > best[-1]) and all(r in ready for _, r in best):
                    self._complete(group, [group.samples[r] for r in sorted(r for _, r in best)],
                                   (best[-1][0], g.tie))
                    continue
            mark = (sorted(finished + least)[g.r0 - 1][0], g.tie)
            floor = mark if floor is None else min(floor, mark)
        return floor

    def _complete(self, group: _Group, samples: list[Sample], mark: Mark | None = None) -> None:
        """``samples`` are the group: its other requests are abandoned (aborted at the step's end)."""
        key = group.launch.key
        del self._groups[key]
        self._account()
        now = self.clock.now()
        for r in group.open:
            rid = group.launch.request_id(r)
            _, _, start = self._requests.pop(rid)
            group.spans.append((r, start, now))
            self._abandoned.append(rid)
        self._news.done.append(GroupDone(key, SampleGroup(group.launch.prompt, samples), mark))

    # --- accounting ----------------------------------------------------------------------------------
    def _account(self) -> None:
        now = self.clock.now()
        self._busy += len(self._requests) * (now - self._last)
        self._last = now

    def _report(self) -> RaceReport:
        report = RaceReport(spans=self._spans, busy_seconds=self._busy, peak=self._peak)
        if self._counts0 is not None:
            stats = self.engine.stats()
            report.preemptions = stats.preemptions - self._counts0[0]
            report.generated_tokens = stats.tokens_generated - self._counts0[1]
        self._groups.clear()
        return report
